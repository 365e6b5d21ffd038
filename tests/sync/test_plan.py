"""Pure parts of the weight sync: bucket planning, configuration checks, metrics (no processes)."""
import re

import pytest
import torch

from megarl.bridge import WeightMap, arch_from_hf_config, tp_split
from megarl.bridge.mapping import REPLICATED
from megarl.rollout.weight_group import bucket_layout
from megarl.sync import SyncConfig, plan_buckets
from megarl.sync.groups import format_update_groups, update_groups_per_server_rank
from megarl.sync.resharder import ROW_ALIGN, LocalParam, gathered_bytes
from megarl.sync.transports import route_address
from megarl.sync.weight_sync import StageReport, summarize

CONFIG = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 47, "max_position_embeddings": 64,
          "rope_theta": 10000.0, "tie_word_embeddings": False}


def shards(weights, tp, dtype_of=lambda name: torch.float32):
    """Every parameter of the model as one TP rank holds it (zeros)."""
    params = []
    for name in weights.mcore_names():
        split, shape = tp_split(name), list(weights.mcore_shape(name))
        if split.dim is not None:
            shape[split.dim] //= tp
        params.append(LocalParam(name, torch.zeros(shape, dtype=dtype_of(name)), split))
    return params


@pytest.fixture
def weights():
    return WeightMap(arch_from_hf_config(CONFIG), padded_vocab_size=64)


@pytest.mark.parametrize("tp", [1, 2])
def test_buckets_keep_order_and_size(weights, tp):
    params = shards(weights, tp)
    limit = 20_000
    plans = plan_buckets(params, weights, tp, limit)
    planned = [p.param for plan in plans for p in plan.params]
    assert [p.name for p in planned] == [p.name for p in params]  # each once, in order
    for plan in plans:
        size = sum(gathered_bytes(p.param, tp) for p in plan.params)
        assert size <= limit or len(plan.params) == 1  # a larger parameter gets a bucket of its own
        hf_names = [s.name for s in plan.hf_slots]
        assert hf_names == [h for p in plan.params for h in weights.hf_names_of(p.param.name)]
    assert any(len(plan.params) == 1 and gathered_bytes(plan.params[0].param, tp) > limit for plan in plans)


def test_only_tp_split_parameters_are_gathered(weights):
    for tp, expect_gathered in ((1, set()), (2, {n for n in weights.mcore_names() if tp_split(n).dim is not None})):
        plans = plan_buckets(shards(weights, tp), weights, tp, 10**9)
        gathered = {p.param.name for p in plans[0].params if p.gather_offset is not None}
        assert gathered == expect_gathered
        assert plans[0].row_bytes % ROW_ALIGN == 0


def test_mixed_dtypes_are_laid_out_aligned_and_cast_on_request(weights):
    # bf16 matrices with fp32 norms: the flat layout puts wider dtypes first, so SGLang's
    # flattened_bucket (which needs every tensor aligned) accepts it
    mixed = shards(weights, 2, lambda n: torch.float32 if "norm" in n else torch.bfloat16)
    plan = plan_buckets(mixed, weights, 2, 10**9)[0]
    slots = plan.hf_slots
    assert {s.dtype for s in slots} == {torch.float32, torch.bfloat16}
    assert all(s.start % s.dtype.itemsize == 0 for s in slots)
    assert [s.dtype.itemsize for s in slots] == sorted((s.dtype.itemsize for s in slots), reverse=True)
    bucket_layout([s.name for s in slots], [str(s.dtype)[6:] for s in slots], [list(s.shape) for s in slots])
    for planned in plan.params:
        if planned.gather_offset is not None:
            assert planned.gather_offset % planned.param.tensor.element_size() == 0
    cast = plan_buckets(mixed, weights, 2, 10**9, dtype=torch.bfloat16)[0]
    assert {s.dtype for s in cast.hf_slots} == {torch.bfloat16}


def test_hf_shapes_drop_vocab_padding(weights):
    plan = plan_buckets(shards(weights, 2), weights, 2, 10**9)[0]
    shapes = {s.name: s.shape for s in plan.hf_slots}
    assert shapes["model.embed_tokens.weight"] == (47, 64) and shapes["lm_head.weight"] == (47, 64)
    assert shapes["model.layers.1.self_attn.k_proj.bias"] == (32,)


def test_config_errors_name_the_setting():
    with pytest.raises(ValueError, match="transport 'nccl' is not one of"):
        SyncConfig(transport="nccl")
    with pytest.raises(ValueError, match="disk transport needs disk_dir and hf_assets_dir"):
        SyncConfig(transport="disk", disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        SyncConfig(bucket_bytes=0, backend="gloo")
    with pytest.raises(ValueError, match="distributed transport needs backend 'nccl' .* or 'gloo' .*got None"):
        SyncConfig(transport="distributed")  # no silent default: the device decides the group's backend


# (transport, mode, PP, DP replicas, TP, EP, ETP) -> weight-update groups per server rank, by hand:
# a stage's ranks are numbered tp + TP * replica (dense) and etp + ETP * (ep + EP * expert-DP replica)
# (experts), so its dense emitters are ranks {TP * d} (d < DP per_emitter, d = 0 per_stage) and its
# expert emitters (EP > 1) ranks {ETP * e, e < EP}; one group per distinct emitter, times PP.
GROUP_CASES = [
    (("distributed", "per_stage", 1, 1, 1, 1, None), 1),
    (("distributed", "per_emitter", 1, 1, 1, 1, None), 1),  # one replica: nothing to split
    (("distributed", "per_stage", 1, 2, 1, 1, None), 1),
    (("distributed", "per_emitter", 1, 2, 1, 1, None), 2),
    (("distributed", "per_stage", 2, 2, 1, 1, None), 2),  # the sync world's DP2 x PP2
    (("distributed", "per_emitter", 2, 2, 1, 1, None), 4),
    (("distributed", "per_stage", 4, 2, 2, 1, None), 4),
    (("distributed", "per_emitter", 4, 2, 2, 1, None), 8),
    (("distributed", "per_stage", 4, 1, 8, 1, None), 4),
    (("distributed", "per_emitter", 1, 2, 2, 1, None), 2),  # the sync world's TP2 x DP2 split story
    # EP: TP1, DP4, EP2 (ETP = TP = 1): dense {0} or {0,1,2,3}, experts {0, 1}
    (("distributed", "per_stage", 1, 4, 1, 2, None), 2),  # the sync world's expert push
    (("distributed", "per_emitter", 1, 4, 1, 2, None), 4),
    # TP2, DP2, EP2, ETP1: dense {0} or {0, 2}, experts {0, 1}
    (("distributed", "per_stage", 1, 2, 2, 2, 1), 2),
    (("distributed", "per_emitter", 1, 2, 2, 2, 1), 3),
    # TP2, DP2, EP2, ETP2 (None: TP): experts {0, 2} are the dense emitters of both replicas
    (("distributed", "per_stage", 1, 2, 2, 2, None), 2),
    (("distributed", "per_emitter", 1, 2, 2, 2, None), 2),
    # PP2, TP1, DP8, EP4: experts {0, 1, 2, 3} per stage
    (("distributed", "per_stage", 2, 8, 1, 4, None), 8),
    (("distributed", "per_emitter", 2, 8, 1, 4, None), 16),
    (("tensor", "per_emitter", 2, 2, 1, 1, None), 0),
    (("disk", "per_stage", 4, 8, 1, 2, None), 0),
]


@pytest.mark.parametrize("args, groups", GROUP_CASES, ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else x)
def test_weight_update_groups_per_server_rank(args, groups):
    assert update_groups_per_server_rank(*args) == groups


def test_weight_update_groups_line_and_options():
    assert format_update_groups("distributed", "per_stage", 2, 2) == \
        "weight sync: 2 weight-update group(s) per rollout server rank (per_stage, PP 2 x DP 2 x EP 1; per_emitter: 4)"
    assert format_update_groups("disk", "per_stage", 2, 2) == "weight sync: no weight-update groups (the disk transport)"
    # the model unknown (no config.json at hand) at EP 2: the count for fused experts (gpt-oss) too
    assert format_update_groups("distributed", "per_stage", 1, 4, 1, 2, 1, None) == \
        "weight sync: 2 weight-update group(s) per rollout server rank (per_stage, PP 1 x DP 4 x EP 2; " \
        "per_emitter: 4); 1 for a model whose experts are sent fused (gpt-oss)"
    with pytest.raises(ValueError, match="weight_update_groups 'per_dp' is not one of"):
        SyncConfig(backend="gloo", weight_update_groups="per_dp")
    # the DP replicas share the push only where that costs no weight-update group
    assert SyncConfig(backend="gloo").weight_update_groups == "per_stage"
    assert not SyncConfig(backend="gloo").shares_dp
    assert SyncConfig(backend="gloo", weight_update_groups="per_emitter").shares_dp
    assert SyncConfig(transport="tensor").shares_dp
    assert not SyncConfig(transport="tensor", split_across_dp=False).shares_dp


def test_metrics_name_the_slowest_stage():
    reports = [StageReport(stage=0, buckets=3, bytes=3_000, seconds=1.0, gather_s=0.2, convert_s=0.3, send_s=0.5),
               StageReport(stage=1, buckets=2, bytes=1_000, seconds=2.0, gather_s=1.5, convert_s=0.1, send_s=0.4)]
    m = summarize(reports, seconds=2.5, prepare_s=0.1, commit_s=0.2)
    assert m["sync/bytes"] == 4_000 and m["sync/buckets"] == 5 and m["sync/stages"] == 2
    assert m["sync/gb_per_s"] == pytest.approx(4_000 / 2.5 / 1e9)
    assert (m["sync/slowest_stage"], m["sync/slowest_stage_s"], m["sync/slowest_stage_gather_s"]) == (1, 2.0, 1.5)


def test_master_address_is_the_route_to_the_servers():
    assert route_address("http://127.0.0.1:30000") == "127.0.0.1"


MOE = {**CONFIG, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True, "head_dim": 16}


@pytest.mark.parametrize("tp,ep,etp", [(1, 2, 1), (2, 4, 1), (2, 2, 2)])
def test_each_ep_rank_plans_only_its_own_experts_after_the_dense_buckets(tp, ep, etp):
    """EP rank r's shards (local experts 0..E/ep-1 under their global names r * E/ep + k, as
    `local_params` lists them): the dense buckets first, then expert buckets of at most `limit`
    bytes gathered over the expert-TP ranks only, whose HF slots hold only this EP rank's experts;
    the dense buckets of one EP rank and the expert buckets of all together name every HF tensor once."""
    weights = WeightMap(arch_from_hf_config(MOE), padded_vocab_size=64)
    per_rank, names, expert_counts = 8 // ep, [], set()
    for ep_rank in range(ep):
        params = []
        for p in shards(weights, tp):
            m = re.search(r"local_experts\.(\d+)\.", p.name)
            if m is None:
                params.append(p)
            elif int(m.group(1)) // per_rank == ep_rank:
                split = p.split if etp > 1 else REPLICATED
                shape = list(weights.mcore_shape(p.name))
                if split.dim is not None:
                    shape[split.dim] //= etp
                params.append(LocalParam(p.name, torch.zeros(shape), split, expert=True))
        limit = 20_000
        plans = plan_buckets(params, weights, tp, limit, etp_size=etp)
        kinds = [plan.expert for plan in plans]
        assert kinds == sorted(kinds) and kinds[-1]  # dense first, then experts
        expert_counts.add(sum(kinds))  # every EP rank plans as many expert buckets (their numbering needs it)
        for plan in (p for p in plans if p.expert):
            assert plan.ranks == etp
            assert sum(gathered_bytes(p.param, tp, etp) for p in plan.params) <= limit or len(plan.params) == 1
            experts = {int(re.search(r"\.experts\.(\d+)\.", s.name).group(1)) for s in plan.hf_slots}
            assert experts <= set(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
            assert all((p.gather_offset is not None) == (etp > 1) for p in plan.params)
        names += [s.name for plan in plans if plan.expert or ep_rank == 0 for s in plan.hf_slots]
    assert len(expert_counts) == 1
    assert sorted(names) == sorted(weights.hf_names())


DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 47,
            "max_position_embeddings": 64, "rope_theta": 10000.0, "q_lora_rank": 40, "kv_lora_rank": 24,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1}


@pytest.mark.parametrize("limit", [1, 5_000, 20_000])
def test_buckets_never_split_what_sglang_fuses_on_load(limit):
    """SGLang fuses a DeepSeek layer's q_a_proj and kv_a_proj_with_mqa only when both come in one
    update_weights call (deepseek_weight_loader.py `cached_a_proj`): they share a bucket, at any limit."""
    weights = WeightMap(arch_from_hf_config(DEEPSEEK), padded_vocab_size=64)
    params = shards(weights, 2)
    plans = plan_buckets(params, weights, 2, limit)
    assert [p.param.name for plan in plans for p in plan.params] == [p.name for p in params]  # order kept
    for layer in range(3):
        holding = {i for i, plan in enumerate(plans) for s in plan.hf_slots
                   if s.name in (f"model.layers.{layer}.self_attn.q_a_proj.weight",
                                 f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight")}
        assert len(holding) == 1, (layer, holding)


def _emitters(mode: str, pp: int, dp: int, tp: int, ep: int, etp: int, fused_experts: bool) -> int:
    """The emitters a push forms for the layout (each forms one weight-update group with the
    distributed transport): `ParallelGroups` of every rank, at the coordinates megatron-core's own
    `RankGenerator` gives it (parallel_state.initialize_model_parallel's order "tp-cp-ep-dp-pp")."""
    from megatron.core.parallel_state import RankGenerator

    from megarl.sync.groups import ParallelGroups

    world, order = tp * dp * pp, "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)

    def position(generator, token):  # rank -> its index in its `token` group
        return {rank: i for group in generator.get_ranks(token) for i, rank in enumerate(group)}

    tp_rank, pp_rank, dp_rank = position(dense, "tp"), position(dense, "pp"), position(dense, "dp")
    ep_rank, etp_rank, edp_rank = position(experts, "ep"), position(experts, "tp"), position(experts, "dp")
    split_dp = SyncConfig(backend="gloo", transport="distributed", weight_update_groups=mode).shares_dp and dp > 1
    expert_fields = lambda r: (dict(ep_size=ep, etp_size=etp, ep_rank=ep_rank[r], etp_rank=etp_rank[r],
                                    expert_dp_rank=edp_rank[r]) if ep > 1 else {})
    ranks = [ParallelGroups(tp_group=None, tp_rank=tp_rank[r], tp_size=tp, pp_rank=pp_rank[r], pp_size=pp,
                            dp_rank=dp_rank[r], emitter_group=None, dp_size=dp, split_dp=split_dp,
                            fused_experts=fused_experts, **expert_fields(r)) for r in range(world)]
    return sum(groups.is_emitter for groups in ranks)


# (PP, DP, TP, EP, ETP): dense and expert layouts megarl's rules allow (ETP 1 or TP; ETP = TP at EP 1)
EMITTER_LAYOUTS = [(1, 1, 1, 1, 1), (2, 2, 1, 1, 1), (1, 2, 2, 1, 2), (1, 4, 1, 2, 1), (1, 2, 2, 2, 1),
                   (1, 2, 2, 2, 2), (2, 8, 1, 4, 1), (2, 4, 2, 4, 1), (1, 4, 2, 2, 2)]


# fused experts (gpt-oss) need expert TP 1 at EP > 1 (ParallelGroups.check)
EMITTER_CASES = [(layout, fused) for layout in EMITTER_LAYOUTS for fused in (False, True)
                 if not (fused and layout[3] > 1 and layout[4] > 1)]


@pytest.mark.parametrize("mode", ["per_stage", "per_emitter"])
@pytest.mark.parametrize("layout, fused", EMITTER_CASES,
                         ids=["PP{}-DP{}-TP{}-EP{}-ETP{}".format(*layout) + ("-fused" if fused else "")
                              for layout, fused in EMITTER_CASES])
def test_plan_counts_the_emitters_the_sync_forms(layout, fused, mode):
    """`megarl plan`'s count equals the emitters `ParallelGroups` makes for the same layout; with
    fused experts (gpt-oss) only EP rank 0 emits experts."""
    pp, dp, tp, ep, etp = layout
    assert update_groups_per_server_rank("distributed", mode, pp, dp, tp, ep, etp, fused) == \
        _emitters(mode, pp, dp, tp, ep, etp, fused)
