"""Grouped-GEMM expert names (megatron's TEGroupedMLP: `mlp.experts.linear_fc1.weight<k>`) against
hand-written SequentialMLP and HF names, both ways, without megatron."""
import pytest

from megarl.bridge import ConversionError, WeightMap, arch_from_hf_config
from megarl.bridge.grouped_experts import grouped_expert_name, is_grouped_expert, sequential_expert_name
from megarl.bridge.mapping import GLU_COLUMN, ROW, canonical_name, tp_split
from megarl.bridge.moe import expert_index, shift_expert

# (grouped spelling, sequential spelling), written out by hand
PAIRS = [
    ("decoder.layers.0.mlp.experts.linear_fc1.weight0", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"),
    ("decoder.layers.0.mlp.experts.linear_fc2.weight0", "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"),
    ("decoder.layers.3.mlp.experts.linear_fc1.weight7", "decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"),
    ("decoder.layers.17.mlp.experts.linear_fc2.weight12",
     "decoder.layers.17.mlp.experts.local_experts.12.linear_fc2.weight"),
    ("module.module.decoder.layers.47.mlp.experts.linear_fc1.weight127",
     "module.module.decoder.layers.47.mlp.experts.local_experts.127.linear_fc1.weight"),
    ("decoder.layers.2.mlp.experts.linear_fc1.bias5", "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.bias"),
]
UNCHANGED = [
    "embedding.word_embeddings.weight",
    "decoder.layers.0.mlp.router.weight",
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
    "decoder.layers.0.mlp.linear_fc1.weight",  # a dense MLP
    "decoder.layers.0.pre_mlp_layernorm.weight",
    "decoder.layers.1.mlp.experts.linear_fc1._extra_state",
]


@pytest.mark.parametrize("grouped, sequential", PAIRS)
def test_grouped_and_sequential_names_translate_both_ways(grouped, sequential):
    assert is_grouped_expert(grouped) and not is_grouped_expert(sequential)
    assert sequential_expert_name(grouped) == sequential
    assert grouped_expert_name(sequential) == grouped
    assert sequential_expert_name(sequential) == sequential and grouped_expert_name(grouped) == grouped
    assert expert_index(grouped) == expert_index(sequential) == int(sequential.split("local_experts.")[1].split(".")[0])


@pytest.mark.parametrize("name", UNCHANGED)
def test_other_names_pass_unchanged(name):
    assert sequential_expert_name(name) == grouped_expert_name(name) == name
    assert expert_index(name) is None


@pytest.mark.parametrize("name", ["decoder.layers.0.mlp.experts.linear_fc1.weight",  # moe_single_grouped_weight
                                  "decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"])
def test_one_tensor_for_all_experts_is_refused_by_name(name):
    with pytest.raises(ConversionError, match="one tensor"):
        sequential_expert_name(name)
    with pytest.raises(ConversionError, match="has no HF mapping|one tensor"):
        canonical_name(name)


def test_shifting_a_grouped_name_is_refused():
    assert shift_expert("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", 4) == \
        "decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight"
    with pytest.raises(ConversionError, match="sequential_expert_name"):
        shift_expert("decoder.layers.0.mlp.experts.linear_fc1.weight3", 4)


def arch(model_type: str):
    if model_type == "mixtral":
        moe = dict(num_local_experts=8, intermediate_size=32)
    else:
        moe = dict(num_experts=8, moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True)
    return arch_from_hf_config(dict(model_type=model_type, vocab_size=100, hidden_size=64, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                    num_experts_per_tok=2, max_position_embeddings=128, rope_theta=10000.0,
                                    **moe))


@pytest.mark.parametrize("model_type, layer, expert, hf", [
    ("qwen3_moe", 2, 5, ("model.layers.2.mlp.experts.5.gate_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight",
                         "model.layers.2.mlp.experts.5.down_proj.weight")),
    ("mixtral", 3, 7, ("model.layers.3.block_sparse_moe.experts.7.w1.weight",
                       "model.layers.3.block_sparse_moe.experts.7.w3.weight",
                       "model.layers.3.block_sparse_moe.experts.7.w2.weight")),
])
def test_the_bridge_maps_grouped_names_to_hf_per_expert_names(model_type, layer, expert, hf):
    weights = WeightMap(arch(model_type), 128)
    fc1, fc2 = (f"decoder.layers.{layer}.mlp.experts.linear_fc{n}.weight{expert}" for n in (1, 2))
    assert weights.hf_names_of(fc1) == hf[:2] and weights.hf_names_of(fc2) == hf[2:]
    assert weights.canonical(fc1) == f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight"
    assert tp_split(fc1) == GLU_COLUMN and tp_split(fc2) == ROW
    assert weights.mcore_shape(fc1) == (64, 64) and weights.mcore_shape(fc2) == (64, 32)
    with pytest.raises(ConversionError, match="expert 8 >= num_experts 8"):
        weights.canonical(f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight8")
