"""A training role's worker group of engines, with the batch cut by data-parallel rank on the way
in and the output ranks' results joined on the way out. Each call names the engine method it runs
(`ActorEngine.update_policy`, an `EngineMethod` on the controller, where megatron is not loaded);
every rank's `TrainWorker.run_engine` runs it by that name. The controller calls the typed role
handles built on this (megarl.runtime.roles)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from megarl.config.devices import Devices
from megarl.data.batch import Batch
from megarl.placement.planner import RolePlacement
from megarl.placement.ray_pools import RealisedPools
from megarl.placement.worker_group import WorkerGroup
from megarl.workers.train_worker import TrainWorker


# keys of a computation's output that are a DP rank's totals over its samples ([L, E] routed tokens
# per expert, `MegatronEngine.forward_tokens`), not rows per sample: summed over the DP ranks
RANK_TOTALS = frozenset({"expert_tokens"})


def join_outputs(parts: list[dict], size: int, padded: bool) -> dict[str, torch.Tensor]:
    """The DP ranks' outputs (`parts`, in DP order) as one dict: per-sample keys concatenated and
    cut to the batch's `size` samples, `RANK_TOTALS` keys summed. A `padded` batch's totals would
    count its padding copies, so they are left out (exact or absent)."""
    joined = {}
    for key in parts[0]:
        if key not in RANK_TOTALS:
            joined[key] = torch.cat([p[key] for p in parts])[:size]
        elif not padded:
            joined[key] = torch.stack([p[key] for p in parts]).sum(0)
    return joined


class EngineMethod:
    """On the controller, an engine's method by name (`EngineClass`'s attributes)."""

    def __init__(self, engine: str, name: str):
        self.engine = engine  # the name of the class it is named on (`ActorEngine`)
        self.__name__ = name
        self.__qualname__ = f"{engine}.{name}"

    def __repr__(self) -> str:
        return f"<engine method {self.__qualname__}>"


class EngineClass:
    """On the controller, an engine class by name, its attributes its methods (`EngineMethod`s):
    megarl.runtime.roles binds the engine classes' names to these and imports the classes only for
    a type checker or an IDE, which so follow `ActorEngine.update_policy` into the engine."""

    def __init__(self, name: str):
        self.__name__ = name

    def __getattr__(self, name: str) -> EngineMethod:
        if name.startswith("_"):  # no engine method; and copy, pickle and the like probe these
            raise AttributeError(f"{self.__name__}.{name}")
        return EngineMethod(self.__name__, name)


class EngineGroup:
    def __init__(self, role: RolePlacement, pools: RealisedPools, config, devices: Devices,
                 timeout_s: float = 3600.0):
        """`devices` (megarl.config.devices): the role's torch.distributed backend and the
        environment its workers start with."""
        self.name = role.name
        self.timeout_s = timeout_s
        self.workers = WorkerGroup(TrainWorker, role, pools, config, env=devices.training_env)
        self.workers.init_process_group(backend=devices.training_backend, timeout_s=min(timeout_s, 600.0))
        places = self.workers.call(TrainWorker.init_engine, timeout_s=timeout_s)
        self.dp_ranks = [p["dp_rank"] for p in places]
        self.output_ranks = {p["dp_rank"]: rank for rank, p in enumerate(places) if p["is_output_rank"]}
        self.dp_size = places[0]["dp_size"]
        if sorted(self.output_ranks) != list(range(self.dp_size)):
            raise RuntimeError(f"{self.name}: expected one output rank per DP rank, got {self.output_ranks}")

    def call(self, method: Callable, *args, **kwargs) -> list:
        """The engine's `method` on every rank with the same arguments; results in rank order."""
        name = method.__name__
        return self.workers.call(TrainWorker.run_engine, name, *args, timeout_s=self.timeout_s, call_name=name,
                                 **kwargs)

    def run_on_batch(self, method: Callable, batch: Batch, *args) -> list:
        """Give each DP replica its contiguous share of `batch` and run the engine's `method`;
        results in rank order."""
        name = method.__name__
        if len(batch) % self.dp_size:
            raise ValueError(f"{self.name}.{name}: {len(batch)} samples do not split over DP size {self.dp_size}")
        shards = batch.chunk(self.dp_size)
        per_rank = [(name, shards[dp], *args) for dp in self.dp_ranks]
        return self.workers.call_each(TrainWorker.run_engine, per_rank, timeout_s=self.timeout_s, call_name=name)

    def compute(self, method: Callable, batch: Batch, *args) -> dict[str, torch.Tensor]:
        """A per-sample computation (log-probs, values, scores): the output ranks' dicts joined in
        DP order (`join_outputs`). A batch that does not split evenly over the DP replicas is padded
        with copies of its last sample, whose results are dropped."""
        size = len(batch)
        pad = -size % self.dp_size
        if pad:
            batch = Batch.concat([batch, batch.select([size - 1] * pad)])
        results = self.run_on_batch(method, batch, *args)
        parts = [results[self.output_ranks[dp]] for dp in range(self.dp_size)]
        return join_outputs(parts, size, padded=pad > 0)

    def update(self, method: Callable, batch: Batch) -> dict[str, float]:
        """An update (update_policy, update_critic): metrics are identical on every rank; take rank 0's."""
        return self.run_on_batch(method, batch)[0]

    def update_and_compute(self, method: Callable, batch: Batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """An update that also returns per-sample outputs (update_policy_with_old_log_probs): each
        rank returns (metrics, identical on every rank; its outputs on output ranks, else None).
        Returns rank 0's metrics and the output ranks' outputs joined in DP order (`join_outputs`)."""
        results = self.run_on_batch(method, batch)
        parts = [results[self.output_ranks[dp]][1] for dp in range(self.dp_size)]
        return results[0][0], join_outputs(parts, len(batch), padded=False)

    def shutdown(self) -> None:
        self.workers.shutdown()
