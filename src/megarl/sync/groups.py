"""Who does what in a weight sync, and the process groups they use.

Every rank of the actor's worker group takes part in `WeightSync.push`, in one of four roles:

- **gatherer**: a rank of a sending replica. It sends its tensor-parallel shards to its stage's
  emitter in that replica, bucket by bucket, over its TP group.
- **emitter**: the gatherer with TP rank 0 (one per stage and sending replica). It receives the
  shards, converts them to HF tensors and pushes them to the rollout servers, in parallel with
  the other emitters (which take turns at the servers).
- **coordinator**: the emitter of stage 0 in replica 0, which is global rank 0 (its TP, PP, DP
  and CP coordinates are all 0). It opens and closes the update on the servers and commits the version.
- every rank of a replica that does not send only waits for the outcome: it holds the same weights.

The replicas (data x context parallel) hold the same weights. With `split_dp` every replica sends:
replica d sends the buckets k of each stage with (count - 1 - k) % dp_size == d (`bucket_share`),
so replica 0 sends each stage's last bucket (the coordinator keeps stage 0's for the commit).
Without it (or with one replica) replica 0 sends everything.

Experts with expert parallelism (EP > 1): each EP rank holds only its experts, so the expert
parameters travel apart from the dense ones, over megatron's expert-tensor-and-model-parallel group
(`expert_group`, EP x expert-TP ranks, group rank = etp_rank + etp_size * ep_rank) of expert-data-
parallel replica 0 (`gathers_experts`), to that group's rank 0: the stage's replica-0 emitter (TP,
DP and EP ranks 0). Those buckets come last in a stage and are sent by replica 0 even with `split_dp`.

The emitters form `emitter_group`, which carries their reports to the coordinator: with one
sending replica, megatron's pipeline-parallel group of the ranks with TP = DP = 0; with several,
a group of every TP-rank-0 rank, made when the groups are read (`from_parallel_state`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    tp_group: Any  # this rank's tensor-parallel process group
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int  # rank among the replicas that hold the same shards (data x context parallel)
    emitter_group: Any  # on emitters: the group of all stages' emitters (pipeline rank order); else None
    world_group: Any = None  # every rank that calls push; None: torch.distributed's default group
    dp_size: int = 1  # replicas that hold the same shards (data x context parallel)
    split_dp: bool = False  # every replica sends its share of the buckets (emitter_group: all their emitters)
    ep_size: int = 1  # expert parallel; with 1 experts travel with the dense parameters over the TP group
    etp_size: int = 1  # expert tensor parallel (ranks one expert is split over), used when ep_size > 1
    expert_group: Any = None  # ep_size > 1: the expert-tensor-and-model-parallel group (ep_size * etp_size ranks)
    expert_group_rank: int = 0  # this rank's rank in expert_group (= etp_rank + etp_size * ep_rank)
    expert_dp_rank: int = 0  # expert-data-parallel replica; replica 0 gathers the experts

    @property
    def gathers_experts(self) -> bool:
        """Whether this rank takes part in the expert gathers (EP > 1, expert-DP replica 0)."""
        return self.ep_size > 1 and self.expert_dp_rank == 0

    @property
    def emits_experts(self) -> bool:
        """Whether this rank receives and converts the expert buckets (rank 0 of its expert group)."""
        return self.gathers_experts and self.expert_group_rank == 0

    @property
    def takes_part(self) -> bool:
        """Whether this rank runs the resharder in a push (dense or expert gathers)."""
        return self.gathers or self.gathers_experts

    @property
    def gathers(self) -> bool:
        return self.split_dp or self.dp_rank == 0

    @property
    def is_emitter(self) -> bool:
        return self.gathers and self.tp_rank == 0

    @property
    def is_coordinator(self) -> bool:
        return self.is_emitter and self.pp_rank == 0 and self.dp_rank == 0

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
        """Global rank of rank 0 of this rank's expert group (ep_size > 1)."""
        return dist.get_global_rank(self.expert_group, 0)

    def check(self) -> None:
        """The coordinator must be rank 0 of the world group (object broadcasts start there), and
        the expert buckets' receiver must be a replica-0 emitter (it pushes them)."""
        if self.emits_experts and not (self.is_emitter and self.dp_rank == 0):
            raise ValueError(f"weight sync: rank {dist.get_rank()} is rank 0 of its expert group but not the "
                             "TP-rank-0 rank of data-parallel replica 0 that emits its stage")
        rank = dist.get_rank(self.world_group)
        if self.is_coordinator != (rank == 0):
            raise ValueError(
                f"weight sync: rank {rank} of the world group is {'' if self.is_coordinator else 'not '}the "
                "coordinator (TP = PP = DP = 0); the coordinator must be rank 0 of the world group"
            )

    @classmethod
    def from_parallel_state(cls, world_group: Optional[Any] = None, split_dp: bool = False) -> "ParallelGroups":
        """The groups of megatron's initialised `parallel_state` (read on this rank). With
        `split_dp` and more than one replica, every rank of `world_group` must call this together
        (it makes the emitters' group)."""
        from megatron.core import parallel_state as ps

        tp_size = ps.get_tensor_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        experts = _expert_fields(ps)
        if split_dp and dp_size > 1:
            return cls(
                tp_group=ps.get_tensor_model_parallel_group(), tp_rank=tp_rank, tp_size=tp_size,
                pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
                dp_rank=dp_rank, emitter_group=_tp_rank_zero_group(tp_rank, world_group), world_group=world_group,
                dp_size=dp_size, split_dp=True, **experts,
            )
        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=dp_rank,
            emitter_group=ps.get_pipeline_model_parallel_group() if dp_rank == 0 and tp_rank == 0 else None,
            world_group=world_group,
            dp_size=dp_size,
            **experts,
        )


def _expert_fields(ps) -> dict[str, Any]:
    """The expert fields of `ParallelGroups` from megatron's `parallel_state` (EP = 1: none).
    Raises if the expert group's rank order is not etp_rank + etp_size * ep_rank, the order the
    resharder reads the gathered rows in (megatron-core 0.16.1 orders expert ranks `tp-ep-dp-pp`)."""
    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return {}
    etp, ep_rank, etp_rank = (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                              ps.get_expert_tensor_parallel_rank())
    group_rank = ps.get_expert_tensor_and_model_parallel_rank()
    if group_rank != etp_rank + etp * ep_rank:
        raise RuntimeError(f"weight sync: rank {group_rank} in the expert-tensor-and-model-parallel group is not "
                           f"etp_rank {etp_rank} + {etp} x ep_rank {ep_rank}; the resharder cannot order its rows")
    return dict(ep_size=ep, etp_size=etp, expert_group=ps.get_expert_tensor_and_model_parallel_group(),
                expert_group_rank=group_rank, expert_dp_rank=ps.get_expert_data_parallel_rank())


def _tp_rank_zero_group(tp_rank: int, world_group: Optional[Any]) -> Any:
    """The group of every rank of `world_group` with TP rank 0, in global rank order (the
    coordinator, global rank 0 of the world group, first); None on the other ranks. Collective."""
    flags = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(flags, (dist.get_rank(), tp_rank == 0), group=world_group)
    members = sorted(rank for rank, zero in flags if zero)
    group = dist.new_group(members)  # every rank of the default group takes part in new_group
    return group if tp_rank == 0 else None
