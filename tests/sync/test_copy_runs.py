"""The resharder's direct writes (`copy_runs` + `write_runs`: HF tensors straight from the TP
shards, no merged tensor) against the bridge's own conversion of the merged tensor (`to_hf`),
for every parameter of tiny models at TP 1, 2 and 4 (4 > the 2 KV groups), bit for bit."""
import pytest
import torch

from megarl.bridge import WeightMap, arch_from_hf_config, load_hf_config
from megarl.bridge.sharding import shard_tp
from megarl.bridge.transforms import padded_vocab_size
from megarl.data.tiny_model import make_tiny_model
from megarl.sync.resharder import copy_runs, write_runs

MODELS = {
    "qwen2-tied-bias": dict(arch="qwen2", tie=True),
    "llama-untied": dict(arch="llama", tie=False),
    "qwen3-headdim": dict(arch="qwen3", tie=False, head_dim=24),
    "qwen3-moe": dict(arch="qwen3_moe", intermediate=32, tie=False),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_direct_writes_equal_to_hf_of_the_merged_tensor(model, tp, tmp_path):
    hf_dir = make_tiny_model(out_dir=tmp_path / model, layers=1, hidden=64, heads=4, kv_heads=2, **MODELS[model])
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    weights = WeightMap(arch, padded_vocab_size(arch.vocab_size, 8, tp))  # 47 -> 48 / 48 / 64 rows: padding dropped
    gen = torch.Generator().manual_seed(tp)
    for name in weights.mcore_names():
        split = weights.tp_split(name)
        full = torch.randn(weights.mcore_shape(name), generator=gen)
        pieces = [shard_tp(split, full, tp, r) for r in range(tp)] if split.dim is not None else [full]
        expected = weights.to_hf(name, full)
        got = [torch.full_like(t, float("nan")) for _, t in expected]  # a row never written stays NaN
        write_runs(copy_runs(weights, name, split, len(pieces)), pieces, got)
        for (hf_name, want), have in zip(expected, got):
            assert torch.equal(have, want), f"{hf_name} (TP={tp}) differs from to_hf of the merged {name}"
