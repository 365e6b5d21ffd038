"""gpt-oss weight pushes: its experts go as the four fused tensors of all experts SGLang 0.5.23's
GptOssForCausalLM loads (the bit-for-bit check of what the resharder emits, at EP1, EP2, TP2 x EP2
and PP2 x EP2 in real megatron-core: tests/bridge/test_gptoss_bridge.py). Here: what still cannot
be pushed is refused by name, and who emits the fused experts."""
import pytest

from megarl.bridge import WeightMap, arch_from_hf_config
from megarl.sync.groups import ParallelGroups
from megarl.sync.weight_sync import SyncConfig, WeightSync, push_problem

GPT_OSS = dict(model_type="gpt_oss", vocab_size=100, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=4, max_position_embeddings=64,
               rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def test_gptoss_pushes_unless_its_experts_go_in_block_fp8():
    """SGLang's gpt-oss loader maps no `weight_scale_inv` of the fused experts
    (`make_expert_params_mapping_fused`): block-FP8 experts are refused by name, the rest pushes."""
    weights = WeightMap(arch_from_hf_config(GPT_OSS), 128)
    assert push_problem(weights) is None
    assert push_problem(weights, frozenset({"model.layers.0.self_attn.q_proj.weight"})) is None
    expert = "model.layers.0.mlp.experts.3.down_proj.weight"
    assert expert in weights.hf_names()
    assert expert in push_problem(weights, frozenset({expert}))
    with pytest.raises(ValueError, match="gpt-oss experts cannot be pushed in block FP8"):
        WeightSync([], weights, ["http://127.0.0.1:1"], SyncConfig(backend="gloo", fp8_weights=frozenset({expert})))


def groups(ep_rank: int, etp_rank: int = 0, fused: bool = True, etp_size: int = 1, expert_dp_rank: int = 0,
           tp_rank: int = 0):
    return ParallelGroups(tp_group=None, tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, emitter_group=None,
                          ep_size=2, etp_size=etp_size, ep_rank=ep_rank, etp_rank=etp_rank,
                          expert_dp_rank=expert_dp_rank, fused_experts=fused)


def test_fused_experts_are_emitted_by_ep_rank_0_alone():
    """Per-expert models: every EP rank emits its own experts; fused ones: EP rank 0 emits all (the
    others take part in its gather), so a stage has one emitter."""
    assert [groups(r, fused=False).emits_experts for r in (0, 1)] == [True, True]
    assert [groups(r).emits_experts for r in (0, 1)] == [True, False]
    assert [groups(r).gathers_experts for r in (0, 1)] == [True, True]
    assert not groups(0, expert_dp_rank=1).gathers_experts
    assert groups(0, fused=False).several_emitters and not groups(0).several_emitters
    with pytest.raises(ValueError, match="expert TP size 1"):
        groups(0, etp_size=2).check()
    with pytest.raises(ValueError, match="not its stage's dense emitter"):
        groups(0, tp_rank=1).check()
