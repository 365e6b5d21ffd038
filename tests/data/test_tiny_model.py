"""Tiny checkpoints of each architecture load back with transformers, offline."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.data.tiny_model import ARCHITECTURES, CHARACTERS, make_tiny_model


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def load(path):
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "deepseek_v3"])  # MLA: below
def test_each_architecture_round_trips(tmp_path, arch):
    out = make_tiny_model(arch, tmp_path / arch, layers=3, hidden=64, heads=4, kv_heads=2, head_dim=24, seed=1)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    model, tokenizer = load(out)
    assert model.config.model_type == arch and type(model).__name__.lower().startswith(arch.replace("_", ""))
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (3, 64, 4, 2, 24)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 24, 64)
    saved = load_file(out / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name

    text = tokenizer.apply_chat_template([{"role": "user", "content": "23+45="}], tokenize=False, add_generation_prompt=True)
    assert text == "<bos>23+45="
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == model.config.bos_token_id == 1 and len(ids) == 7
    assert tokenizer.decode(ids, skip_special_tokens=True) == "23+45="
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 7, 47) and torch.isfinite(logits).all()


def test_defaults_are_the_quickstart_calibration(tmp_path):
    model, tokenizer = load(make_tiny_model("qwen2", tmp_path / "m"))
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (2, 128, 4, 2)
    assert c.tie_word_embeddings and c.vocab_size == len(tokenizer) == 47
    assert sum(p.numel() for p in model.parameters()) == 302_080  # "a 302k-parameter Qwen2"
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id] == [0, 1, 2, 3]
    assert tokenizer(CHARACTERS, add_special_tokens=False)["input_ids"] == list(range(4, 47))
    reply = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}], tokenize=False
    )
    assert reply == "<bos>1+1=2<eos>"


def test_padded_vocab_untied_embeddings_and_dtype(tmp_path):
    out = make_tiny_model("llama", tmp_path / "m", vocab=64, tie=False, dtype="bfloat16")
    saved = load_file(out / "model.safetensors")
    assert saved["model.embed_tokens.weight"].shape == (64, 128)
    assert saved["lm_head.weight"].dtype == torch.bfloat16
    assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    model, tokenizer = load(out)
    assert model.config.vocab_size == 64 and len(tokenizer) == 47


def test_same_seed_same_weights(tmp_path):
    a = load_file(make_tiny_model("qwen3", tmp_path / "a", seed=5) / "model.safetensors")
    b = load_file(make_tiny_model("qwen3", tmp_path / "b", seed=5) / "model.safetensors")
    c = load_file(make_tiny_model("qwen3", tmp_path / "c", seed=6) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"arch": "gpt2"}, "unknown architecture 'gpt2'"),
        ({"vocab": 40}, r"vocab \(40\) must be at least the tokenizer's 47 tokens"),
        ({"heads": 4, "kv_heads": 3}, r"heads \(4\) must be a multiple of kv_heads \(3\)"),
        ({"hidden": 100, "heads": 3, "kv_heads": 1}, r"hidden \(100\) must be a multiple of heads \(3\)"),
    ],
)
def test_impossible_shapes_are_refused(tmp_path, kwargs, message):
    arch = kwargs.pop("arch", "qwen2")
    with pytest.raises(ValueError, match=message):
        make_tiny_model(arch, tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_the_tiny_deepseek_v3_has_multi_latent_attention_and_a_dense_first_layer(tmp_path):
    out = make_tiny_model("deepseek_v3", tmp_path / "ds", layers=2, hidden=64, heads=4, kv_heads=4, seed=1)
    model, tokenizer = load(out)
    c = model.config
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.head_dim) == \
        (32, 16, 16, 8, 16, 8)
    assert model.model.layers[0].self_attn.q_b_proj.weight.shape == (4 * 24, 32)
    assert not hasattr(model.model.layers[0].mlp, "gate") and model.model.layers[1].mlp.gate.weight.shape == (8, 64)
    ids = tokenizer("<bos>23+45=", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 7, 47) and torch.isfinite(logits).all()
