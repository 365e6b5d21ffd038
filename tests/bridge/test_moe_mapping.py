"""MoE mapping without megatron: on-disk names against HF's own fused in-memory experts, the pure
EP x ETP sharding round trip, and MoE conversions refused where they are not supported."""
import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout, WeightMap, arch_from_hf_config, load_hf_config
from megarl.bridge.convert import convert_hf_to_torch_dist
from megarl.bridge.sharding import merge_model, shard_model
from megarl.data.tiny_model import MOE_ARCHITECTURES, make_tiny_model
from tiny_hf import hf_tensors


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {a: make_tiny_model(a, root / a, layers=2, hidden=32, heads=4, kv_heads=2, intermediate=16, seed=i)
            for i, a in enumerate(MOE_ARCHITECTURES)}


def weights_of(hf_dir, tp=1):
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    return WeightMap(arch, 128)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_megatron_expert_tensors_equal_hf_fused_in_memory_experts(arch, moe_dirs):
    """transformers 5 holds experts fused ([E, 2F, H] gate_up_proj, [E, H, F] down_proj); megatron's
    per-expert fc1 = [gate; up] and fc2 = down, built from the on-disk names, equal its slices."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dirs[arch], dtype=torch.float32)
    weights = weights_of(moe_dirs[arch])
    hf = hf_tensors(moe_dirs[arch])
    experts = dict(model.named_parameters())
    assert weights.arch.moe.num_experts == 8 and weights.arch.moe.topk == 2
    for layer in range(2):
        fused = f"model.layers.{layer}.mlp.experts."
        for e in range(8):
            fc1 = weights.to_mcore(f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight", hf.__getitem__)
            fc2 = weights.to_mcore(f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight", hf.__getitem__)
            assert torch.equal(fc1, experts[fused + "gate_up_proj"][e])
            assert torch.equal(fc2, experts[fused + "down_proj"][e])
        router = weights.to_mcore(f"decoder.layers.{layer}.mlp.router.weight", hf.__getitem__)
        assert torch.equal(router, experts[f"model.layers.{layer}.mlp.gate.weight"])


@pytest.mark.parametrize("layout", [ParallelLayout(ep=2), ParallelLayout(tp=2, ep=4, etp=1), ParallelLayout(tp=2, pp=2, ep=2),
                                    ParallelLayout(tp=2)], ids=str)
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_pure_sharding_round_trip_is_bit_exact(arch, layout, moe_dirs):
    weights = weights_of(moe_dirs[arch])
    hf = hf_tensors(moe_dirs[arch])
    full = {n: weights.to_mcore(n, hf.__getitem__) for n in weights.mcore_names()}
    shards = shard_model(weights, full, layout)
    per_rank = weights.arch.moe.num_experts // layout.ep
    assert all(len([k for k in sd if k.endswith("local_experts.0.linear_fc1.weight")]) == 2 // layout.pp
               and not any(f"local_experts.{per_rank}." in k for k in sd) for sd in shards.values())
    merged = merge_model(weights, shards, layout)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[n], full[n]) for n in full)


def test_torch_dist_conversion_of_moe_is_refused(moe_dirs, tmp_path):
    with pytest.raises(ConversionError, match="mixture-of-experts model; torch_dist conversion"):
        convert_hf_to_torch_dist(moe_dirs["qwen3_moe"], tmp_path / "out")


@pytest.mark.parametrize("layout", [ParallelLayout(ep=2), ParallelLayout(tp=2, ep=4, etp=1), ParallelLayout(tp=2, pp=2, ep=2)],
                         ids=str)
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_grouped_gemm_names_shard_and_merge_back_to_the_hf_checkpoint(arch, layout, moe_dirs):
    """Shards named as megatron's TEGroupedMLP names them (`experts.linear_fc1.weight<k>`, k local)
    hold the right global expert and merge back into the HF checkpoint bit for bit."""
    weights = weights_of(moe_dirs[arch])
    hf = hf_tensors(moe_dirs[arch])
    full = {n: weights.to_mcore(n, hf.__getitem__) for n in weights.mcore_names()}
    shards = shard_model(weights, full, layout, spelling="grouped")
    per_rank = 8 // layout.ep
    for key, sd in shards.items():
        ep_rank = key[3]
        grouped = {f"decoder.layers.{i}.mlp.experts.linear_fc{n}.weight{k}" for i in range(2 // layout.pp)
                   for n in (1, 2) for k in range(per_rank)}
        assert {n for n in sd if ".mlp.experts." in n} == grouped
        if key[:3] == (0, 0, 0):  # layer 0, local expert 1 = global expert ep_rank * per_rank + 1
            e = ep_rank * per_rank + 1
            proj = ("gate_proj", "up_proj") if arch != "mixtral" else ("w1", "w3")
            prefix = f"model.layers.0.{'block_sparse_moe' if arch == 'mixtral' else 'mlp'}.experts.{e}."
            whole = torch.cat([hf[prefix + f"{p}.weight"] for p in proj])
            expected = whole if layout.expert_tp == 1 else torch.cat([h.chunk(2)[0] for h in whole.chunk(2)])
            assert torch.equal(sd["decoder.layers.0.mlp.experts.linear_fc1.weight1"], expected)
    back = {h: t for name, f in merge_model(weights, shards, layout).items() for h, t in weights.to_hf(name, f)}
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)
