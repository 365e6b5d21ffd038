"""`TrainWorker`: the Ray actor of one rank of a training role (actor, ref, critic); it hosts that
role's Megatron engine."""
from __future__ import annotations

from megarl.placement.worker_group import RankedWorker

ENGINES = {"actor": "ActorEngine", "ref": "RefEngine", "critic": "CriticEngine"}


class TrainWorker(RankedWorker):
    def __init__(self, rank: int, world_size: int, role: str, config):
        super().__init__(rank, world_size, role)
        self.config = config
        self.engine = None

    def init_engine(self) -> dict:
        """Build the role's engine (after `init_process_group`); returns its data-parallel place."""
        from megarl.engines import megatron as engines  # imported here: megatron loads in the worker only

        self.engine = getattr(engines, ENGINES[self.role])(self.config)
        return {"dp_rank": self.engine.dp_rank, "dp_size": self.engine.dp_size,
                "is_output_rank": self.engine.is_output_rank}

    def engine_call(self, method: str, *args, **kwargs):
        """Run one engine method (compute_log_prob, update_policy, save_checkpoint, ...)."""
        return getattr(self.engine, method)(*args, **kwargs)
