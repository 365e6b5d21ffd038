"""Offline conversion (`megarl.bridge.convert`) of checkpoints with a multi-token-prediction (MTP) layer: a tiny
DeepSeek-V3 (fp32) and a tiny GLM-4.5 (glm4_moe, bf16), made by HF's own classes with one layer more, that
layer then stored as the hub stores an MTP layer (`make_tiny_model(mtp_layers=1)`: `model.layers.2.{enorm,
hnorm,eh_proj,shared_head.norm}` and copies of the embedding and LM head). Checked: HF -> torch_dist -> HF gives
back every tensor of the original file (read with safetensors) with its name, dtype and bytes; the converter
writes exactly the keys a real megatron-core `GPTModel` with its MTP block saves (megatron's own
`sharded_state_dict` is the oracle), which are the keys of the engine's checkpoint request; a checkpoint without
MTP tensors converts as transformers saves one (none); partial MTP layers, a copy that differs, and MTP keys
under a config without MTP layers are refused by name."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.bridge import ConversionError, WeightMap, arch_from_hf_config, load_hf_config
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.torch_dist_io import TorchDistReader, expected_objects, expected_tensors, te_moe_norm_key
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers
from mtp_bridge_world import keys_world

FAMILIES = {"deepseek_v3": "float32", "glm4_moe": "bfloat16"}
L = 2  # a dense and an MoE decoder layer; the MTP layer is HF layer 2
PADDED_VOCAB = 128  # the tokenizer's 47 tokens, padded to a multiple of 128 (the converter's default)


def write_mtp_checkpoint(family: str, out, seed: int = 0):
    """The tiny `family` checkpoint with one MTP layer; every norm 1 + 0.2 N(0, 1) and the routers' selection
    bias 0.1 N(0, 1) (HF initialises them to ones and zeros, which a swapped mapping would not show)."""
    make_tiny_model(family, out, layers=L, hidden=64, heads=4, kv_heads=2, tie=False, seed=seed, mtp_layers=1,
                    dtype=FAMILIES[family])
    tensors = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = (1 + 0.2 * torch.randn(t.shape, generator=g)).to(t.dtype)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = (0.1 * torch.randn(t.shape, generator=g)).to(t.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp_convert")
    return {family: write_mtp_checkpoint(family, root / family, seed) for seed, family in enumerate(FAMILIES)}


def read_hf(hf_dir) -> dict:
    """Every tensor of an HF directory, read with safetensors itself."""
    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_same_bytes(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_mtp_layer_survives_hf_to_torch_dist_to_hf_bit_exact(family, checkpoints, tmp_path):
    hf_dir = checkpoints[family]
    original = read_hf(hf_dir)
    assert {f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.shared_head.head.weight",
            f"model.layers.{L}.mlp.gate.weight"} <= set(original)
    convert_hf_to_torch_dist(hf_dir, tmp_path / "mcore")
    reader = TorchDistReader(tmp_path / "mcore")
    # the MTP layer's own tensors, by hand: megatron's eh_proj is HF's, its decoder layer's router HF's gate
    assert torch.equal(reader.read("mtp.layers.0.eh_proj.weight"), original[f"model.layers.{L}.eh_proj.weight"])
    assert torch.equal(reader.read("mtp.layers.0.final_layernorm.weight"),
                       original[f"model.layers.{L}.shared_head.norm.weight"])
    assert torch.equal(reader.read("mtp.layers.0.transformer_layer.mlp.router.weight"),
                       original[f"model.layers.{L}.mlp.gate.weight"])
    expert = original[f"model.layers.{L}.mlp.experts.3.gate_proj.weight"], \
        original[f"model.layers.{L}.mlp.experts.3.up_proj.weight"]
    assert torch.equal(reader.read("mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight"),
                       torch.cat(expert))
    convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", max_shard_bytes=200_000)
    assert_same_bytes(read_hf(tmp_path / "hf"), original)


def test_the_converter_writes_the_mtp_keys_megatron_and_the_engine_save(checkpoints):
    """megatron-core's own `sharded_state_dict` of `GPTModel(mtp_block_spec=...)` (local spec: its
    MoE pre-MLP norm under the TE key, as the engine keeps it) is the oracle for the keys, global shapes and
    `_extra_state` objects; the engine asks for exactly the tensor keys the converter writes."""
    configs = {family: load_hf_config(path) for family, path in checkpoints.items()}
    (result,) = run_gloo_workers(keys_world, 1, args=(configs, PADDED_VOCAB), timeout_s=300)
    for family, (megatron, engine) in result.items():
        weights = WeightMap(arch_from_hf_config(configs[family]), PADDED_VOCAB, mtp=True)
        ours = {k: e.global_shape for k, e in expected_tensors(weights, lambda n: torch.float32).items()}
        megatron = {te_moe_norm_key(k): v for k, v in megatron.items()}
        assert {k: v for k, v in megatron.items() if v is not None} == ours, family
        assert {k for k, v in megatron.items() if v is None} == set(expected_objects(weights.arch, 1)), family
        assert engine == ours, family
        assert ours["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"] == (8, 256, 64)


def test_a_checkpoint_without_its_mtp_tensors_converts_as_transformers_saves_it(tmp_path):
    """transformers' DeepseekV3 / Glm4Moe classes have no MTP modules: `save_pretrained` writes none of its
    tensors and keeps `num_nextn_predict_layers` (1 by default) in config.json, and `from_pretrained` skips them
    (`_keys_to_ignore_on_load_unexpected`). Such a checkpoint converts without an MTP block, both ways."""
    import transformers

    hf_dir = make_tiny_model("deepseek_v3", tmp_path / "hf", layers=L, hidden=64, heads=4, tie=False)
    assert load_hf_config(hf_dir)["num_nextn_predict_layers"] == 1
    assert not any(n.startswith(f"model.layers.{L}.") for n in read_hf(hf_dir))
    assert transformers.DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected == [r"model\.layers\.61.*"]
    convert_hf_to_torch_dist(hf_dir, tmp_path / "mcore")
    assert not any(k.startswith("mtp.") for k in TorchDistReader(tmp_path / "mcore").tensors)
    convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "back")
    assert_same_bytes(read_hf(tmp_path / "back"), read_hf(hf_dir))


def _rewrite(hf_dir, out, change) -> None:
    out.mkdir()
    for path in hf_dir.iterdir():
        if path.suffix != ".safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    tensors = load_file(hf_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def test_a_partial_mtp_layer_is_refused_naming_the_missing_tensor(checkpoints, tmp_path):
    _rewrite(checkpoints["deepseek_v3"], tmp_path / "hf", lambda t: t.pop(f"model.layers.{L}.eh_proj.weight"))
    with pytest.raises(ConversionError, match=rf"config.json announces 1 multi-token-prediction layer.*but not 1 of "
                                              rf"them, e.g. \['model.layers.{L}.eh_proj.weight'\]"):
        convert_hf_to_torch_dist(tmp_path / "hf", tmp_path / "mcore")
    assert not (tmp_path / "mcore").exists()


def test_an_mtp_copy_of_the_embedding_that_differs_is_refused(checkpoints, tmp_path):
    def change(tensors):
        tensors[f"model.layers.{L}.embed_tokens.weight"][0, 0] += 1

    _rewrite(checkpoints["glm4_moe"], tmp_path / "hf", change)
    with pytest.raises(ConversionError, match=rf"'model.layers.{L}.embed_tokens.weight' differs from "
                                              r"'model.embed_tokens.weight'"):
        convert_hf_to_torch_dist(tmp_path / "hf", tmp_path / "mcore")


def test_mtp_keys_under_a_config_without_mtp_layers_are_refused(checkpoints, tmp_path):
    convert_hf_to_torch_dist(checkpoints["deepseek_v3"], tmp_path / "mcore")
    config = json.loads((checkpoints["deepseek_v3"] / "config.json").read_text())
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConversionError, match="holds multi-token-prediction layers .* has no num_nextn_predict_layers"):
        convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", hf_config_dir=tmp_path / "plain")
