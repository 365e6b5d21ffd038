"""Shared fixtures of the engine tests: tiny HF checkpoints (built once per session)."""
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# engine_world.py is imported by name, also by the spawned gloo workers
sys.path.insert(0, str(Path(__file__).parent))

from megarl.bridge.convert import convert_hf_to_torch_dist  # noqa: E402
from megarl.data.tiny_model import make_tiny_model  # noqa: E402

TINY = dict(layers=4, hidden=64, heads=4, kv_heads=2)  # 4 layers: PP=2 x VPP=2 has one layer per chunk


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"qwen2": tied embeddings + qkv bias, "llama": untied lm_head, "qwen2_rm": the qwen2 backbone
    with a reward-model `score.weight` [1, H]} as HF checkpoint directories; vocabulary 47 (the
    engine pads it to 128 rows, so padded-column masking matters). "qwen2_mcore": the qwen2
    checkpoint converted to megatron `torch_dist` by the bridge."""
    root = tmp_path_factory.mktemp("engine_models")
    models = {
        "qwen2": make_tiny_model("qwen2", root / "qwen2", seed=0, **TINY),
        "llama": make_tiny_model("llama", root / "llama", seed=1, tie=False, **TINY),
    }
    rm = make_tiny_model("qwen2", root / "qwen2_rm", seed=0, **TINY)
    tensors = load_file(rm / "model.safetensors")
    tensors["score.weight"] = torch.randn(1, TINY["hidden"], generator=torch.Generator().manual_seed(5)) * 0.1
    save_file(tensors, rm / "model.safetensors", metadata={"format": "pt"})
    models["qwen2_rm"] = rm
    models["qwen2_mcore"] = convert_hf_to_torch_dist(models["qwen2"], root / "qwen2_mcore").out
    return models
