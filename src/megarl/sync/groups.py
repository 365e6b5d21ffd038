"""Who does what in a weight sync, and the process groups they use.

Every rank of the actor's worker group takes part in `WeightSync.push`, in one of four roles:

- **gatherer**: a rank of a sending replica. It sends its tensor-parallel shards to its stage's
  emitter in that replica, bucket by bucket, over its TP group.
- **emitter**: a rank with buckets to send: it receives the shards of a gather, converts them to
  HF tensors and pushes them to the rollout servers, in parallel with the other emitters (which
  take turns at the servers). The gatherer with TP rank 0 emits its stage's dense buckets (one per
  stage and sending replica, `emits_dense`); with EP > 1 each EP rank's expert-TP rank 0 emits its
  own experts (`emits_experts`, below). A rank may be both.
- **coordinator**: the dense emitter of stage 0 in replica 0, which is global rank 0 (its TP, PP,
  DP and CP coordinates are all 0). It opens and closes the update on the servers and commits the version.
- every rank of a replica that does not send only waits for the outcome: it holds the same weights.

The replicas (data x context parallel) hold the same weights. With `split_dp` every replica sends:
replica d sends the dense buckets k of each stage with (count - 1 - k) % dp_size == d
(`bucket_share`). Without it (or with one replica) replica 0 sends every dense bucket.
`WeightSync` splits only where it costs no weight-update group (`SyncConfig.shares_dp`): with the
distributed transport each emitter forms a group that every rollout server TP rank joins, so by
default (`weight_update_groups="per_stage"`) replica 0 alone sends, as slime (`slime-pp_{pp_rank}`,
from DP = TP = 0) and AReaL (`update_weight_group_{pp_rank}`) do; `update_groups_per_server_rank`
counts the groups.

Experts with expert parallelism (EP > 1): each EP rank holds only its experts, so the expert
parameters travel apart from the dense ones. In expert-data-parallel replica 0 (`gathers_experts`)
every EP rank plans the buckets of its own experts under their global names and gathers them over
its expert-tensor-parallel group (`expert_tp_group`, megatron's, `etp_size` ranks) to its expert-TP
rank 0, which emits them: the EP ranks emit in parallel, and no rank receives another EP rank's
experts. Those buckets come after a stage's dense ones and are sent by expert-DP replica 0 even
with `split_dp`. But where the servers load a layer's experts only as fused tensors of all of them
(`fused_experts`, gpt-oss: SGLang 0.5.23's GptOssForCausalLM), the EP ranks gather their experts
over megatron's expert-model-parallel group (`ep_group`) to EP rank 0, which alone emits them
(expert TP must be 1 there, as megatron-core requires for gpt-oss's expert biases).

The emitters form `emitter_group`, which carries their reports to the coordinator: with one
emitter per stage (one sending replica, EP = 1), megatron's pipeline-parallel group of the ranks
with TP = DP = 0; else a group of every emitter, made when the groups are read (`from_parallel_state`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

# SyncConfig.weight_update_groups: one group per pipeline stage (and EP rank's experts), or one per emitter
WEIGHT_UPDATE_GROUPS = ("per_stage", "per_emitter")


@dataclass(frozen=True)
class ParallelGroups:
    tp_group: Any  # this rank's tensor-parallel process group
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int  # rank among the replicas that hold the same shards (data x context parallel)
    emitter_group: Any  # on emitters: the group of every emitter (global rank order, the coordinator first); else None
    world_group: Any = None  # every rank that calls push; None: torch.distributed's default group
    dp_size: int = 1  # replicas that hold the same shards (data x context parallel)
    split_dp: bool = False  # every replica sends its share of the dense buckets
    ep_size: int = 1  # expert parallel; with 1 experts travel with the dense parameters over the TP group
    etp_size: int = 1  # expert tensor parallel (ranks one expert is split over), used when ep_size > 1
    ep_rank: int = 0  # this rank's EP rank (ep_size > 1): it holds global experts [ep_rank * E / ep_size, ...)
    etp_rank: int = 0  # this rank's rank in expert_tp_group
    expert_tp_group: Any = None  # ep_size > 1: megatron's expert-tensor-parallel group (etp_size ranks)
    expert_dp_rank: int = 0  # expert-data-parallel replica; replica 0 sends the experts
    ep_group: Any = None  # ep_size > 1: megatron's expert-model-parallel group (ep_size ranks, EP rank order)
    fused_experts: bool = False  # the servers load a layer's experts only whole: EP rank 0 emits every expert

    @property
    def gathers_experts(self) -> bool:
        """Whether this rank takes part in the expert gathers (EP > 1, expert-DP replica 0)."""
        return self.ep_size > 1 and self.expert_dp_rank == 0

    @property
    def emits_experts(self) -> bool:
        """Whether this rank receives, converts and pushes its EP rank's expert buckets (expert-TP rank 0;
        with `fused_experts`, EP rank 0's, for every EP rank's experts)."""
        return self.gathers_experts and self.etp_rank == 0 and (self.ep_rank == 0 or not self.fused_experts)

    @property
    def takes_part(self) -> bool:
        """Whether this rank runs the resharder in a push (dense or expert gathers)."""
        return self.gathers or self.gathers_experts

    @property
    def gathers(self) -> bool:
        return self.split_dp or self.dp_rank == 0

    @property
    def emits_dense(self) -> bool:
        """Whether this rank emits its stage's dense buckets (its replica's share): TP rank 0 of a sending replica."""
        return self.gathers and self.tp_rank == 0

    @property
    def is_emitter(self) -> bool:
        """Whether this rank has buckets to send (dense, expert or both): it holds a transport."""
        return self.emits_dense or self.emits_experts

    @property
    def several_emitters(self) -> bool:
        """More than one emitter in the world: stages, sending replicas, or EP ranks (EP > 1: each
        EP rank's expert-TP rank 0 in expert-DP replica 0 is a rank of its own)."""
        return self.pp_size * self.bucket_share()[1] > 1 or (self.ep_size > 1 and not self.fused_experts)

    @property
    def is_coordinator(self) -> bool:
        return self.emits_dense and self.pp_rank == 0 and self.dp_rank == 0

    def bucket_share(self) -> tuple[int, int]:
        """(this replica's share, number of shares) of each stage's buckets."""
        return (self.dp_rank, self.dp_size) if self.split_dp else (0, 1)

    def owns(self, index: int, count: int) -> bool:
        """Whether this replica sends bucket `index` of a stage's `count` (the last one: replica 0)."""
        share, shares = self.bucket_share()
        return (count - 1 - index) % shares == share

    @property
    def tp_emitter_rank(self) -> int:
        """Global rank of this rank's TP rank 0 (its stage's emitter, for DP replica 0)."""
        return dist.get_global_rank(self.tp_group, 0) if self.tp_size > 1 else dist.get_rank()

    def coordinator_rank(self) -> int:
        """Global rank of the coordinator: rank 0 of the world group."""
        return 0 if self.world_group is None else dist.get_global_rank(self.world_group, 0)

    @property
    def expert_emitter_rank(self) -> int:
        """Global rank of expert-TP rank 0 of this rank's expert-TP group (its EP rank's expert emitter);
        with `fused_experts`, of EP rank 0 of its EP group."""
        if self.fused_experts:
            return dist.get_global_rank(self.ep_group, 0)
        return dist.get_global_rank(self.expert_tp_group, 0) if self.etp_size > 1 else dist.get_rank()

    @property
    def expert_gather_group(self) -> Any:
        """The group of the expert buckets' gathers: the expert-TP group, or with `fused_experts`
        the EP group (row r: EP rank r's experts)."""
        return self.ep_group if self.fused_experts else self.expert_tp_group

    def check(self) -> None:
        """The coordinator must be rank 0 of the world group (object broadcasts start there); fused
        experts gather whole experts only (expert TP 1), to a rank that also emits dense buckets (with
        megatron's rank order EP rank 0's is its stage's dense emitter: `update_groups_per_server_rank`),
        so the stages' emitters stay one per stage."""
        if self.fused_experts and self.ep_size > 1 and self.etp_size > 1:
            raise ValueError(f"weight sync: fused experts (gpt-oss) need expert TP size 1, got {self.etp_size}")
        if self.fused_experts and self.emits_experts and not self.emits_dense:
            raise ValueError("weight sync: the fused experts' emitter (EP rank 0) is not its stage's dense emitter; "
                             "megatron's default rank order makes it so")
        rank = dist.get_rank(self.world_group)
        if self.is_coordinator != (rank == 0):
            raise ValueError(
                f"weight sync: rank {rank} of the world group is {'' if self.is_coordinator else 'not '}the "
                "coordinator (TP = PP = DP = 0); the coordinator must be rank 0 of the world group"
            )

    @classmethod
    def from_parallel_state(cls, world_group: Optional[Any] = None, split_dp: bool = False,
                            timeout_s: Optional[float] = None, fused_experts: bool = False) -> "ParallelGroups":
        """The groups of megatron's initialised `parallel_state` (read on this rank). With more than
        one emitter per stage (`split_dp` and more than one replica, or EP > 1), every rank of
        `world_group` must call this together (it makes the emitters' group, whose collectives are
        bounded by `timeout_s` seconds; None: torch's default). `fused_experts`: the model's
        experts are sent fused (`megarl.bridge.fused_experts.fuses_experts`)."""
        from megatron.core import parallel_state as ps

        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        groups = cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            tp_rank=tp_rank,
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=dp_rank,
            emitter_group=None,
            world_group=world_group,
            dp_size=dp_size,
            split_dp=split_dp and dp_size > 1,
            fused_experts=fused_experts,
            **_expert_fields(ps),
        )
        if groups.split_dp or (groups.ep_size > 1 and not groups.fused_experts):
            group = _emitters_group(groups.is_emitter, world_group, timeout_s)
        else:  # one emitter per stage: TP = DP = 0 (with fused experts also EP rank 0's expert emitter)
            group = ps.get_pipeline_model_parallel_group() if groups.is_emitter else None
        return replace(groups, emitter_group=group)


def update_groups_per_server_rank(transport: str, mode: str, pp: int, dp: int, tp: int = 1, ep: int = 1,
                                  etp: Optional[int] = None, fused_experts: bool = False) -> int:
    """Weight-update groups each rollout server TP rank joins: one per emitter of the actor (each
    forms its own, `DistributedTransport`), so one NCCL communicator each on GPUs. 0 for the
    tensor and disk transports, which make none.

    `mode`: `SyncConfig.weight_update_groups`; `pp`, `tp`: the actor's pipeline and tensor parallel
    sizes; `dp`: its replicas (data x context parallel); `ep`, `etp`: expert parallel and expert
    tensor parallel sizes (None: TP, megatron's default). Megatron's default rank order
    (`parallel_state.initialize_model_parallel`, order "tp-cp-ep-dp-pp") numbers a stage's ranks
    tp + TP * replica for the dense layers and etp + ETP * (ep + EP * expert-DP replica) for the
    experts, so within a stage the dense emitters (TP rank 0 of each sending replica) are ranks
    TP * d, and the expert emitters (expert-TP rank 0 of each EP rank in expert-DP replica 0) are
    ranks ETP * e: EP rank 0's is the stage's dense emitter of replica 0. A rank that emits both
    holds one group. `fused_experts` (gpt-oss, `megarl.bridge.fused_experts.fuses_experts`): EP rank
    0 alone emits every expert (`ParallelGroups.emits_experts`), so the experts add no group."""
    if transport != "distributed":
        return 0
    if mode not in WEIGHT_UPDATE_GROUPS:
        raise ValueError(f"weight_update_groups {mode!r} is not one of {list(WEIGHT_UPDATE_GROUPS)}")
    replicas = dp if mode == "per_emitter" else 1
    dense = {tp * d for d in range(replicas)}
    experts = {(etp or tp) * e for e in range(1 if fused_experts else ep)} if ep > 1 else set()
    return pp * len(dense | experts)


def format_update_groups(transport: str, mode: str, pp: int, dp: int, tp: int = 1, ep: int = 1,
                         etp: Optional[int] = None, fused_experts: Optional[bool] = False) -> str:
    """One line for `megarl plan`: the weight-update groups per rollout server rank, with the other
    mode's count (same arguments as `update_groups_per_server_rank`; `fused_experts` None: the model
    is not known, so at EP > 1 the line gives the count for fused experts too)."""
    if transport != "distributed":
        return f"weight sync: no weight-update groups (the {transport} transport)"
    n = update_groups_per_server_rank(transport, mode, pp, dp, tp, ep, etp, bool(fused_experts))
    other = "per_emitter" if mode == "per_stage" else "per_stage"
    m = update_groups_per_server_rank(transport, other, pp, dp, tp, ep, etp, bool(fused_experts))
    line = (f"weight sync: {n} weight-update group(s) per rollout server rank ({mode}, PP {pp} x DP {dp} x "
            f"EP {ep}; {other}: {m})")
    fused = update_groups_per_server_rank(transport, mode, pp, dp, tp, ep, etp, True)
    if fused_experts is None and fused != n:
        line += f"; {fused} for a model whose experts are sent fused (gpt-oss)"
    return line


def _expert_fields(ps) -> dict[str, Any]:
    """The expert fields of `ParallelGroups` from megatron's `parallel_state` (EP = 1: none)."""
    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return {}
    return dict(ep_size=ep, etp_size=ps.get_expert_tensor_parallel_world_size(),
                ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank(),
                expert_tp_group=ps.get_expert_tensor_parallel_group(), ep_group=ps.get_expert_model_parallel_group(),
                expert_dp_rank=ps.get_expert_data_parallel_rank())


def _emitters_group(is_emitter: bool, world_group: Optional[Any], timeout_s: Optional[float] = None) -> Any:
    """The group of every emitter of `world_group`, in global rank order (the coordinator, global
    rank 0 of the world group, first); None on the other ranks. Collective."""
    flags = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(flags, (dist.get_rank(), is_emitter), group=world_group)
    members = sorted(rank for rank, emits in flags if emits)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    group = dist.new_group(members, timeout=timeout)  # every rank of the default group takes part in new_group
    return group if is_emitter else None
