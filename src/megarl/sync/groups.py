"""Who does what in a weight sync, and the process groups they use.

Every rank of the actor's worker group takes part in `WeightSync.push`, in one of four roles:

- **gatherer**: a rank of data-parallel replica 0 (context-parallel rank 0 too). It sends its
  tensor-parallel shards to its stage's emitter, bucket by bucket, over its TP group.
- **emitter**: the gatherer with TP rank 0 of each pipeline stage. It receives the shards of its
  stage, converts them to HF tensors and pushes them to the rollout servers, in parallel with the
  emitters of the other stages.
- **coordinator**: the emitter of stage 0, which is global rank 0 (its TP, PP, DP and CP
  coordinates are all 0). It opens and closes the update on the servers and commits the version.
- every other rank (DP replicas > 0) only waits for the outcome: they hold the same weights.

The emitters of all stages form megatron's pipeline-parallel group of the ranks with TP = DP = 0,
so that group carries the stage reports to the coordinator.
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

    @property
    def gathers(self) -> bool:
        return self.dp_rank == 0

    @property
    def is_emitter(self) -> bool:
        return self.gathers and self.tp_rank == 0

    @property
    def is_coordinator(self) -> bool:
        return self.is_emitter and self.pp_rank == 0

    @property
    def tp_emitter_rank(self) -> int:
        """Global rank of this rank's TP rank 0 (its stage's emitter, for DP replica 0)."""
        return dist.get_global_rank(self.tp_group, 0) if self.tp_size > 1 else dist.get_rank()

    def coordinator_rank(self) -> int:
        """Global rank of the coordinator: rank 0 of the world group."""
        return 0 if self.world_group is None else dist.get_global_rank(self.world_group, 0)

    def check(self) -> None:
        """The coordinator must be rank 0 of the world group (object broadcasts start there)."""
        rank = dist.get_rank(self.world_group)
        if self.is_coordinator != (rank == 0):
            raise ValueError(
                f"weight sync: rank {rank} of the world group is {'' if self.is_coordinator else 'not '}the "
                "coordinator (TP = PP = DP = 0); the coordinator must be rank 0 of the world group"
            )

    @classmethod
    def from_parallel_state(cls, world_group: Optional[Any] = None) -> "ParallelGroups":
        """The groups of megatron's initialised `parallel_state` (read on this rank)."""
        from megatron.core import parallel_state as ps

        tp_size = ps.get_tensor_model_parallel_world_size()
        tp_rank = ps.get_tensor_model_parallel_rank()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        return cls(
            tp_group=ps.get_tensor_model_parallel_group(),
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=dp_rank,
            emitter_group=ps.get_pipeline_model_parallel_group() if dp_rank == 0 and tp_rank == 0 else None,
            world_group=world_group,
        )
