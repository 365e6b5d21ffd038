"""The CPU engine's map between a transformers model's fused in-memory experts and checkpoint names,
checked against the checkpoint HF's own `save_pretrained` wrote (read with safetensors) and the
model transformers loaded from it."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megarl.data.tiny_model import MOE_ARCHITECTURES, make_tiny_model
from megarl.rollout.cpu.checkpoint_names import checkpoint_named_tensors, checkpoint_tensor


@pytest.fixture(scope="module", params=[*MOE_ARCHITECTURES, "qwen2"])
def saved(request, tmp_path_factory):
    """(the checkpoint's tensors by name, the model transformers loads from it)."""
    out = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param), layers=2, hidden=32, heads=4,
                          kv_heads=2, intermediate=16, seed=3)
    return load_file(out / "model.safetensors"), AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)


def test_every_checkpoint_tensor_is_found_in_the_loaded_model_with_its_values(saved):
    disk, model = saved
    state = model.state_dict()
    for name, tensor in disk.items():
        found = checkpoint_tensor(state, name)
        assert found is not None, name
        assert torch.equal(found, tensor), name
    assert checkpoint_tensor(state, "model.layers.0.mlp.experts.99.gate_proj.weight") is None
    assert checkpoint_tensor(state, "model.layers.0.nonsense.weight") is None


def test_checkpoint_names_of_the_model_are_the_checkpoints_names(saved):
    disk, model = saved
    named = dict(checkpoint_named_tensors(model.named_parameters(), mixtral=model.config.model_type == "mixtral"))
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert named.keys() == disk.keys() - tied
    assert all(torch.equal(named[n], disk[n]) for n in named)


def test_writing_a_checkpoint_tensor_writes_that_slice_of_the_model_only(saved):
    disk, model = saved
    model = type(model)(model.config)  # a fresh copy: the fixture's model stays as loaded
    state = model.state_dict()
    name = next((n for n in disk if ".experts.3." in n and ("up_proj" in n or ".w3." in n)), "model.norm.weight")
    before = {k: v.clone() for k, v in state.items()}
    checkpoint_tensor(state, name).copy_(torch.full_like(disk[name], 7.0))
    after = model.state_dict()
    changed = sum(int((after[k] != before[k]).sum()) for k in after)
    assert changed == disk[name].numel()  # that expert's up rows, and nothing else
    assert torch.equal(checkpoint_tensor(after, name), torch.full_like(disk[name], 7.0))


def test_a_cpu_engine_takes_a_pushed_moe_checkpoint_by_its_names_and_reports_them(tmp_path):
    """A push of every tensor of a second checkpoint (per-expert names, as the resharder sends them)
    makes the served model equal that checkpoint as transformers loads it; the weights checker's
    names are the checkpoint's, and its hashes are the hashes of the checkpoint's tensors."""
    from megarl.rollout.cpu.engine import CPUEngine
    from megarl.rollout.cpu.checkpoint_names import model_tensors
    from megarl.rollout.weights_checker import checksum_response, tensor_checksum

    size = dict(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=16)
    served = make_tiny_model("qwen3_moe", tmp_path / "a", seed=1, **size)
    pushed = make_tiny_model("qwen3_moe", tmp_path / "b", seed=2, **size)
    engine = CPUEngine(str(served))
    try:
        tensors = load_file(pushed / "model.safetensors")
        assert engine.load_weights(list(tensors.items())) == len(tensors)
        expected = AutoModelForCausalLM.from_pretrained(pushed, dtype=torch.float32).state_dict()
        got = engine.model.state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
        checksums = checksum_response(model_tensors(engine.model))["ranks"][0]["checksums"]
        assert checksums == {name: tensor_checksum(t) for name, t in tensors.items() if name != "lm_head.weight"
                             or not engine.model.config.tie_word_embeddings}
    finally:
        engine.shutdown()


def test_a_cpu_engine_serving_gpt_oss_takes_exactly_sglangs_fused_expert_names(tmp_path):
    """gpt-oss: SGLang 0.5.23's GptOssForCausalLM loads a layer's experts only as the checkpoint's four
    fused tensors of all experts (models/gpt_oss.py `_load_normal_weights`), and skips per-expert
    names without a word. The CPU engine takes the fused tensors (a second checkpoint pushed whole
    makes the served model transformers' load of it), reports them under those names, and refuses
    what SGLang would not load: per-expert names (the shape of one here equals the slice the Qwen
    layout would take, so only the name can refuse it) and a fused tensor of some experts only."""
    from megarl.rollout.cpu.engine import CPUEngine
    from megarl.rollout.cpu.checkpoint_names import model_tensors
    from megarl.rollout.protocol import BadRequestError

    size = dict(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=16)  # H = 2F: per-expert [F, H] = [H/2, 2F]
    served = make_tiny_model("gpt_oss", tmp_path / "a", seed=1, **size)
    pushed = make_tiny_model("gpt_oss", tmp_path / "b", seed=2, **size)
    engine = CPUEngine(str(served))
    try:
        tensors = load_file(pushed / "model.safetensors")
        assert "model.layers.1.mlp.experts.gate_up_proj_bias" in tensors
        bad = [("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(16, 32)),
               ("model.layers.0.mlp.experts.gate_up_proj", tensors["model.layers.0.mlp.experts.gate_up_proj"][:4])]
        for name, tensor in bad:
            with pytest.raises(BadRequestError, match="unknown weight name|has shape"):
                engine.load_weights([(name, tensor)])
        assert engine.load_weights(list(tensors.items())) == len(tensors)
        expected = AutoModelForCausalLM.from_pretrained(pushed, dtype=torch.float32).state_dict()
        got = engine.model.state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
        reported = dict(model_tensors(engine.model))
        tied = {"lm_head.weight"} if engine.model.config.tie_word_embeddings else set()
        buffers = {name for name, _ in engine.model.named_buffers()}  # rotary frequencies, no checkpoint tensors
        assert reported.keys() - buffers == tensors.keys() - tied
        assert all(torch.equal(reported[name], tensors[name]) for name in reported.keys() - buffers)
    finally:
        engine.shutdown()
