"""Shared fixtures of the engine tests: tiny HF checkpoints (built once per session)."""
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# engine_world.py is imported by name, also by the gloo workers
sys.path.insert(0, str(Path(__file__).parent))

from megarl.bridge.convert import HF_ASSETS_DIR, convert_hf_to_torch_dist  # noqa: E402
from megarl.bridge.torch_dist_io import TorchDistReader  # noqa: E402
from megarl.data.tiny_model import make_tiny_model  # noqa: E402

TINY = dict(layers=4, hidden=64, heads=4, kv_heads=2)  # 4 layers: PP=2 x VPP=2 has one layer per chunk


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{"qwen2": tied embeddings + qkv bias, "llama": untied lm_head, "qwen2_rm": the qwen2 backbone
    with a reward-model `score.weight` [1, H]} as HF checkpoint directories; vocabulary 47 (the
    engine pads it to 128 rows, so padded-column masking matters). "qwen2_mcore": the qwen2
    checkpoint converted to megatron `torch_dist` by the bridge; "qwen2_verl_dist" the same weights as a bare
    torch_dist directory and "qwen2_reseeded" another qwen2 of the same shapes (verl's use_dist_checkpointing)."""
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
    # verl's use_dist_checkpointing: a bare torch_dist directory (what megatron's dist_checkpointing.save
    # writes: no iteration directory, no HF files), beside an HF directory of the same architecture with
    # other weights (seed 7), which gives the config only
    shutil.copytree(TorchDistReader(models["qwen2_mcore"]).dir, root / "qwen2_verl_dist",
                    ignore=shutil.ignore_patterns(HF_ASSETS_DIR))
    models["qwen2_verl_dist"] = root / "qwen2_verl_dist"
    models["qwen2_reseeded"] = make_tiny_model("qwen2", root / "qwen2_reseeded", seed=7, **TINY)
    return models
