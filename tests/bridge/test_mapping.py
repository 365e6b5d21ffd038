"""The pure mapping: name coverage, tensor layouts, TP/PP/VPP sharding and bit-exact round trips."""
import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout, WeightMap, arch_from_hf_config, merge_model, shard_model
from megarl.bridge.mapping import GLU_COLUMN, canonical_name
from megarl.bridge.sharding import shard_tp, unshard_tp
from megarl.bridge.transforms import merge_qkv, pad_vocab, padded_vocab_size, split_qkv
from tiny_hf import DIVISIBLE_BY, VARIANTS, hf_config, hf_tensors

LAYOUTS = [ParallelLayout(1, 1, 1), ParallelLayout(2, 1, 1), ParallelLayout(1, 2, 1), ParallelLayout(2, 2, 1),
           ParallelLayout(1, 4, 2), ParallelLayout(4, 1, 1)]


def weight_map(variant, tp=1):
    arch = arch_from_hf_config(hf_config(variant).to_dict())
    return WeightMap(arch, padded_vocab_size(arch.vocab_size, DIVISIBLE_BY, tp))


def to_full(weights, hf):
    return {name: weights.to_mcore(name, hf.__getitem__) for name in weights.mcore_names()}


def to_hf(weights, full):
    return {h: t for name, tensor in full.items() for h, t in weights.to_hf(name, tensor)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_hf_tensor_is_consumed_exactly_once(variant, tiny_models):
    hf_dir, model = tiny_models[variant]
    weights = weight_map(variant)
    names = weights.hf_names()
    assert len(names) == len(set(names))
    expected = set(model.state_dict()) - ({"lm_head.weight"} if weights.arch.tie_word_embeddings else set())
    assert set(names) == expected
    weights.check_hf_names(set(hf_tensors(hf_dir)), source=str(hf_dir))
    assert len(weights.mcore_names()) == len(set(weights.mcore_names()))


def test_missing_and_unexpected_hf_tensors_are_named():
    weights = weight_map("llama")
    names = set(weights.hf_names())
    with pytest.raises(ConversionError, match="missing.*model.layers.0.self_attn.q_proj.weight"):
        weights.check_hf_names(names - {"model.layers.0.self_attn.q_proj.weight"}, "ckpt")
    with pytest.raises(ConversionError, match="o_proj.bias"):
        weights.check_hf_names(names | {"model.layers.3.self_attn.o_proj.bias"}, "ckpt")
    with pytest.raises(ConversionError, match="model.layers.8"):
        weights.check_hf_names(names | {"model.layers.8.mlp.up_proj.weight"}, "ckpt")
    weights.check_hf_names(names | {"model.layers.0.self_attn.rotary_emb.inv_freq"}, "ckpt")


@pytest.mark.parametrize("nh, ng", [(8, 2), (4, 4), (4, 1)])
def test_fused_qkv_is_grouped_per_query_group(nh, ng):
    d, hidden, r = 3, 5, nh // ng
    q, k, v = (torch.randn(n * d, hidden) for n in (nh, ng, ng))
    fused = merge_qkv(q, k, v, nh, ng, d)
    for h in range(nh):  # query head h sits in group h // r, slot h % r
        row = ((h // r) * (r + 2) + h % r) * d
        assert torch.equal(fused[row : row + d], q[h * d : (h + 1) * d])
    for g in range(ng):
        assert torch.equal(fused[(g * (r + 2) + r) * d :][:d], k[g * d : (g + 1) * d])
        assert torch.equal(fused[(g * (r + 2) + r + 1) * d :][:d], v[g * d : (g + 1) * d])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, nh, ng, d), (q, k, v)))
    bias = merge_qkv(q[:, 0], k[:, 0], v[:, 0], nh, ng, d)
    assert torch.equal(bias, fused[:, 0])


def test_fc1_is_split_across_tp_in_gate_and_up_halves():
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    fc1 = torch.cat([gate, up])
    shards = [shard_tp(GLU_COLUMN, fc1, 2, k) for k in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    assert torch.equal(unshard_tp(GLU_COLUMN, shards), fc1)
    assert not torch.equal(torch.cat(shards), fc1)  # a naive concatenation is wrong


def test_vocab_is_padded_with_zero_rows():
    assert [padded_vocab_size(100, 8, tp) for tp in (1, 2, 4)] == [104, 112, 128]
    assert padded_vocab_size(151936, 128, 1) == 151936 and padded_vocab_size(151936, 128, 8) == 152576
    w = torch.randn(100, 4)
    padded = pad_vocab(w, 112)
    assert torch.equal(padded[:100], w) and not padded[100:].any()


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_through_every_layout_is_bit_exact(variant, layout, tiny_models):
    hf = hf_tensors(tiny_models[variant][0])
    weights = weight_map(variant, layout.tp)
    full = to_full(weights, hf)
    shards = shard_model(weights, full, layout)
    assert len(shards) == layout.tp * layout.pp * layout.vpp
    merged = merge_model(weights, shards, layout)
    assert merged.keys() == full.keys() and all(torch.equal(merged[n], full[n]) for n in full)
    back = to_hf(weights, merged)
    assert back.keys() == set(weights.hf_names())
    for name, tensor in back.items():
        assert tensor.dtype == hf[name].dtype and torch.equal(tensor, hf[name]), name


def test_bf16_round_trip_keeps_dtype_and_bits(tiny_models):
    hf = {k: v.to(torch.bfloat16) for k, v in hf_tensors(tiny_models["qwen2"][0]).items()}
    weights, layout = weight_map("qwen2", 2), ParallelLayout(2, 2, 1)
    back = to_hf(weights, merge_model(weights, shard_model(weights, to_full(weights, hf), layout), layout))
    assert all(back[n].dtype == torch.bfloat16 and torch.equal(back[n], hf[n]) for n in hf)


def test_shards_have_megatron_shapes_and_local_layer_names(tiny_models):
    hf = hf_tensors(tiny_models["llama"][0])
    weights = weight_map("llama", 2)
    shards = shard_model(weights, to_full(weights, hf), ParallelLayout(2, 2, 1))
    stage1 = shards[(1, 0, 1)]
    assert sorted(k for k in stage1 if not k.startswith("decoder.layers.")) == ["decoder.final_layernorm.weight",
                                                                               "output_layer.weight"]
    assert {int(k.split(".")[2]) for k in stage1 if k.startswith("decoder.layers.")} == {0, 1, 2, 3}
    assert stage1["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((8 + 2 * 2) * 8 // 2, 64)
    assert stage1["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 8 * 8 // 2)
    assert stage1["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, 64)
    assert stage1["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 48)
    assert stage1["decoder.layers.0.input_layernorm.weight"].shape == (64,)
    assert stage1["output_layer.weight"].shape == (112 // 2, 64)
    assert torch.equal(stage1["decoder.layers.0.input_layernorm.weight"], hf["model.layers.4.input_layernorm.weight"])
    # PP=4 x VPP=2: chunk (pp=1, vp=1) holds global layer 4 + 1 = 5
    vpp = shard_model(weights, to_full(weights, hf), ParallelLayout(1, 4, 2))
    assert torch.equal(vpp[(1, 1, 0)]["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.5.mlp.down_proj.weight"])
    assert "embedding.word_embeddings.weight" in vpp[(0, 0, 0)] and "embedding.word_embeddings.weight" not in vpp[(0, 1, 0)]


def test_tied_embeddings_keep_a_last_stage_copy_only_with_pipelining(tiny_models):
    weights = weight_map("qwen2", 2)
    full = to_full(weights, hf_tensors(tiny_models["qwen2"][0]))
    assert "output_layer.weight" not in full
    single = shard_model(weights, full, ParallelLayout(2, 1, 1))
    assert all("output_layer.weight" not in sd for sd in single.values())
    piped = shard_model(weights, full, ParallelLayout(2, 2, 1))
    for k in range(2):
        assert torch.equal(piped[(1, 0, k)]["output_layer.weight"], piped[(0, 0, k)]["embedding.word_embeddings.weight"])
    broken = {key: dict(sd) for key, sd in piped.items()}
    broken[(1, 0, 1)]["output_layer.weight"] = broken[(1, 0, 1)]["output_layer.weight"] + 1
    with pytest.raises(ConversionError, match="tied embeddings"):
        merge_model(weights, broken, ParallelLayout(2, 2, 1))


def test_merge_accepts_te_names_wrapper_prefixes_and_extra_state(tiny_models):
    weights, layout = weight_map("qwen3", 2), ParallelLayout(2, 2, 1)
    full = to_full(weights, hf_tensors(tiny_models["qwen3"][0]))
    te = shard_model(weights, full, layout, spelling="te")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te[(0, 0, 0)]
    wrapped = {key: {f"module.module.{k}": v for k, v in sd.items()} for key, sd in te.items()}
    for sd in wrapped.values():
        sd["module.decoder.layers.0.mlp.linear_fc1._extra_state"] = None
    merged = merge_model(weights, wrapped, layout)
    assert all(torch.equal(merged[n], full[n]) for n in full)
    assert canonical_name("module.decoder.layers.3.pre_mlp_layernorm.weight") == "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"


def test_merge_rejects_inconsistent_or_incomplete_shards(tiny_models):
    weights, layout = weight_map("llama", 2), ParallelLayout(2, 1, 1)
    shards = shard_model(weights, to_full(weights, hf_tensors(tiny_models["llama"][0])), layout)
    diverged = {key: dict(sd) for key, sd in shards.items()}
    diverged[(0, 0, 1)]["decoder.final_layernorm.weight"] = diverged[(0, 0, 1)]["decoder.final_layernorm.weight"] * 2
    with pytest.raises(ConversionError, match="replicated on TP ranks but rank 1 differs"):
        merge_model(weights, diverged, layout)
    with pytest.raises(ConversionError, match=r"no state dict for .* \[\(0, 0, 1\)\]"):
        merge_model(weights, {(0, 0, 0): shards[(0, 0, 0)]}, layout)
    extra = {key: dict(sd) for key, sd in shards.items()}
    extra[(0, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.bias"] = torch.zeros(48)
    with pytest.raises(ConversionError, match="linear_qkv.bias"):
        merge_model(weights, extra, layout)


def test_wrong_shapes_are_named():
    weights = weight_map("llama")
    good = {n: torch.zeros(weights.hf_shape(n)) for n in weights.hf_names()}
    bad = dict(good, **{"model.layers.2.self_attn.k_proj.weight": torch.zeros(32, 64)})
    with pytest.raises(ConversionError, match=r"model.layers.2.self_attn.k_proj.weight: shape \[32, 64\]"):
        weights.to_mcore("decoder.layers.2.self_attention.linear_qkv.weight", bad.__getitem__)
    with pytest.raises(ConversionError, match="decoder.layers.0.mlp.linear_fc1.weight"):
        weights.to_hf("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(96, 64))
    with pytest.raises(ConversionError, match="has no HF mapping"):
        weights.to_hf("decoder.layers.0.mlp.linear_fc2.bias", torch.zeros(64))
    # o_proj's bias maps in gpt-oss only (biases on every linear)
    with pytest.raises(ConversionError, match="does not exist in this llama config"):
        weights.to_hf("decoder.layers.0.self_attention.linear_proj.bias", torch.zeros(64))
