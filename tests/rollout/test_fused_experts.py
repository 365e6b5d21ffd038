"""Weight updates of an MoE model into the CPU engine: per-expert HF names (what checkpoints and
pushes carry) land in transformers 5's fused expert tensors as transformers' own loader puts them."""
import pytest
import torch
from safetensors.torch import load_file

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.cpu_engine import CPUEngine, load_causal_lm
from megarl.rollout.protocol import BadRequestError


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_per_expert_names_load_like_transformers_loads_the_checkpoint(tmp_path, arch):
    sizes = dict(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=16)
    served, other = (make_tiny_model(arch, tmp_path / name, seed=seed, **sizes) for name, seed in (("a", 1), ("b", 2)))
    engine = CPUEngine(str(served))
    try:
        pushed = load_file(other / "model.safetensors")
        assert any(".experts.0." in name for name in pushed)  # on-disk names, one per expert
        assert engine.load_weights(list(pushed.items())) == len(pushed)
        expected = load_causal_lm(str(other), torch.float32).state_dict()  # transformers' own fusing
        got = engine.model.state_dict()
        assert got.keys() == expected.keys()
        for name in got:
            assert torch.equal(got[name], expected[name]), name
        with pytest.raises(BadRequestError, match="unknown weight name"):
            engine.load_weights([("model.layers.0.mlp.experts.99.down_proj.weight", torch.zeros(32, 16))])
    finally:
        engine.shutdown()
