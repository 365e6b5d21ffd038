"""MoE mapping without megatron: on-disk names against HF's own fused in-memory experts, the pure
EP x ETP sharding round trip, and the offline HF <-> torch_dist conversion and its tools (what
megatron itself writes and reads is checked in test_moe_bridge.py)."""
import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout, WeightMap, arch_from_hf_config, load_hf_config
from megarl.bridge.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
from megarl.bridge.torch_dist_io import TorchDistReader
from megarl.bridge.sharding import merge_model, shard_model
from megarl.data.tiny_model import MOE_ARCHITECTURES, make_tiny_model
from test_convert import run_tool
from tiny_hf import hf_tensors


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {a: make_tiny_model(a, root / a, layers=2, hidden=32, heads=4, kv_heads=2, head_dim=12, intermediate=16, seed=i)
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


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_hf_to_torch_dist_to_hf_is_bit_exact(arch, moe_dirs, tmp_path):
    """Experts stored with a layer and an expert axis ([L, E, 2F, H] fc1, [L, E, H, F] fc2), router
    [L, E, H], the pre-MLP norm under the TE key; back to HF bit for bit (GQA, head_dim 12 != 32 / 4)."""
    convert_hf_to_torch_dist(moe_dirs[arch], tmp_path / "mcore", ParallelLayout(ep=2))
    tensors = {k: e.global_shape for k, e in TorchDistReader(tmp_path / "mcore").tensors.items()}
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (2, 8, 32, 32)
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (2, 8, 32, 16)
    assert tensors["decoder.layers.mlp.router.weight"] == (2, 8, 32)
    assert tensors["decoder.layers.pre_mlp_layernorm.weight"] == (2, 32)
    assert ("decoder.layers.mlp.shared_experts.gate_weight" in tensors) == (arch == "qwen2_moe")
    convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf")
    hf, back = hf_tensors(moe_dirs[arch]), hf_tensors(tmp_path / "hf")
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_moe_tools_convert_both_ways_and_transformers_loads_the_result(moe_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = moe_dirs["qwen2_moe"]  # the shared expert and its gate
    to_mcore = run_tool("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "mcore", "--tp", 2, "--ep", 2)
    assert to_mcore.returncode == 0, to_mcore.stderr
    assert "for TP=2 PP=1 VPP=1 EP=2 ETP=2" in to_mcore.stdout
    to_hf = run_tool("convert_megatron_to_hf.py", "--ckpt", tmp_path / "mcore", "--out", tmp_path / "hf")
    assert to_hf.returncode == 0, to_hf.stderr
    ids = torch.tensor([[1, 5, 9, 30, 46, 2]])
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (hf_dir, tmp_path / "hf")]
    with torch.no_grad():
        assert torch.equal(models[0](ids).logits, models[1](ids).logits)
    bad = run_tool("convert_hf_to_megatron.py", "--hf", hf_dir, "--out", tmp_path / "bad", "--ep", 3)
    assert bad.returncode == 2 and "num_experts=8 is not a multiple of ep=3" in bad.stderr, bad.stderr


def test_a_config_with_another_expert_count_is_refused_by_name(moe_dirs, tmp_path):
    """A config whose expert count differs from the checkpoint's is refused before anything is written."""
    import json

    convert_hf_to_torch_dist(moe_dirs["qwen3_moe"], tmp_path / "mcore")
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((moe_dirs["qwen3_moe"] / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_experts": 4}))
    with pytest.raises(ConversionError, match=r"router.weight has shape \[8, 32\], but the config implies \[4, 32\]"):
        convert_torch_dist_to_hf(tmp_path / "mcore", tmp_path / "hf", hf_config_dir=other)
    assert not (tmp_path / "hf").exists()


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


def test_lora_adapters_on_experts_are_refused_by_name(moe_dirs, tmp_path):
    """megarl's LoRA adapts an MoE model's attention only (its merge and PEFT export handle those);
    a checkpoint with adapters on the experts cannot be merged exactly and is refused naming them,
    by `megarl export` (plain / --merged) and --lora alike."""
    import json

    import torch.distributed.checkpoint as dcp

    from megarl.bridge.lora import read_adapters
    from megarl.bridge.torch_dist_io import MEGATRON_METADATA

    expert_adapter = "decoder.layers.mlp.experts.experts.linear_fc1_lora.gate_proj_A"
    state = {"embedding.word_embeddings.weight": torch.zeros(128, 32),
             "decoder.layers.self_attention.linear_qkv_lora.q_proj_A": torch.zeros(2, 4, 32),
             expert_adapter: torch.zeros(2, 8, 4, 32)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "ckpt" / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    with pytest.raises(ConversionError, match=f"LoRA adapters on modules megarl cannot merge or export, e.g. \\['{expert_adapter}'\\]"):
        convert_torch_dist_to_hf(tmp_path / "ckpt", tmp_path / "hf", hf_config_dir=moe_dirs["qwen3_moe"], lora_scale=2.0)
    with pytest.raises(ConversionError, match="experts, router or shared expert"):
        read_adapters(TorchDistReader(tmp_path / "ckpt"))
    assert not (tmp_path / "hf").exists()
