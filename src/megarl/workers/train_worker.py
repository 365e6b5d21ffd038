"""`TrainWorker`: the Ray actor of one rank of a training role (actor, ref, critic, reward model,
teacher); it hosts that role's Megatron engine (`engine_class`). The controller's role handles
(megarl.runtime.roles) name an engine method once, `ActorEngine.update_policy`; `EngineGroup` sends
its name to every rank's `run_engine`, which runs it on the engine after checking it is a public
method of the engine's class. The worker's own methods are its setup and the actor's weight push.
"""
from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megarl.workers.base import RankedWorker
from megarl.workers.profiling import StepTrace

if TYPE_CHECKING:  # megatron loads in the worker only (`engine_class`)
    from megarl.engines.megatron import ActorEngine, CriticEngine, RefEngine, RewardModelEngine, TeacherEngine
    from megarl.engines.megatron.engine import MegatronEngine


def adapter_dir(config) -> str:
    """Where adapter-only sync with `lora.sync_via=disk` writes the actor's PEFT adapters (readable
    by every rollout server)."""
    return str((Path(config.trainer.default_local_dir) / "lora_sync").absolute())


def engine_class(role: str) -> type[MegatronEngine]:
    """The engine class a training role's workers host (imported here: megatron loads in the worker only)."""
    from megarl.engines.megatron.reward_model import RewardModelEngine
    from megarl.engines.megatron.roles import ActorEngine, CriticEngine, RefEngine, TeacherEngine

    return {"actor": ActorEngine, "ref": RefEngine, "critic": CriticEngine, "reward_model": RewardModelEngine,
            "teacher": TeacherEngine}[role]


class TrainWorker(RankedWorker):
    def __init__(self, rank: int, world_size: int, role: str, config):
        super().__init__(rank, world_size, role)
        self.config = config
        self.engine: ActorEngine | RefEngine | CriticEngine | RewardModelEngine | TeacherEngine | None = None
        self.weight_sync = None
        self.trace: StepTrace | None = None  # global_profiler.tool=torch (`start_profile`)

    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> bool:
        """Join the role's world: `timeout_s` (seconds) bounds the join, actor_rollout_ref.nccl_timeout
        (seconds) every collective of the world. The world is the default group of everything the
        engine runs besides megatron's groups (`init_role_parallel_state` gives those the same key):
        megatron's dist_checkpointing saves and loads use the two, so checkpoints are covered."""
        return super().init_process_group(master_addr, master_port, backend, timeout_s,
                                          collective_timeout_s=self.config.actor_rollout_ref.nccl_timeout)

    def init_engine(self) -> dict:
        """Build the role's engine (after `init_process_group`); returns its data-parallel place."""
        self.engine = engine_class(self.role)(self.config)
        self.trace = StepTrace(self.config, self.role, self.rank, self.world_size,
                               on_cuda=self.engine.device.type == "cuda")
        return {"dp_rank": self.engine.dp_rank, "dp_size": self.engine.dp_size,
                "is_output_rank": self.engine.is_output_rank}

    def run_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The engine's `method` on `args` and `kwargs`, and what it returns: every call of the role
        handles (megarl.runtime.roles) comes here. Refused (TypeError naming the role, the method and
        the engine's class): a name with a leading underscore, or that is no function defined on the
        engine's class (an instance attribute, a property, another role's method)."""
        engine_cls = type(self.engine)
        defined = next((vars(cls)[method] for cls in engine_cls.__mro__ if method in vars(cls)), None)
        if method.startswith("_") or not inspect.isfunction(defined):
            raise TypeError(f"{self.role}: {method!r} is not a public method of its engine, {engine_cls.__name__}")
        return getattr(self.engine, method)(*args, **kwargs)

    # ------------------------------------------------------------------ verl's profiler
    def start_profile(self, step: int) -> None:
        """Start recording training step `step` (from 1) on this rank, if its role's profiler selects it."""
        self.trace.start(step)

    def stop_profile(self) -> str | None:
        """Stop recording and write the trace; its path, or None on a rank not profiled."""
        return self.trace.stop()

    # ------------------------------------------------------------------ the actor's weight push
    def init_weight_sync(self, server_urls: list[str], sync_config, version: int = 0,
                         api_key: str | None = None) -> None:
        """Actor only: prepare pushing this engine's weights into the rollout servers, whose last
        pushed version is `version` and whose API key is `api_key`. Called again when the server set
        changed (a server restarted): the previous sync's weight-update groups are dropped first."""
        from megarl.sync import WeightSync
        from megarl.sync.weight_sync import servers_weight_map
        from megarl.sync.adapter_sync import AdapterSync

        if self.weight_sync is not None:
            self.weight_sync.close()
        model = self.config.actor_rollout_ref.model
        if model.lora.rank > 0 and model.lora.sync == "adapter":
            self.weight_sync = AdapterSync(
                self.engine.lora_adapters, model.lora.rank, model.lora.alpha, model.path, server_urls,
                adapter_dir(self.config) if model.lora.sync_via == "disk" else None, via=model.lora.sync_via,
                api_key=api_key, initial_version=version, timeout_s=sync_config.timeout_s)
            return
        weights = servers_weight_map(self.engine.weight_map, model.mtp.enable and model.mtp.enable_rollout)
        self.weight_sync = WeightSync(self.engine.model_chunks, weights, server_urls, sync_config,
                                      api_key=api_key, initial_version=version)

    def push_weights(self, version: int | None = None, flush: list[bool] | None = None) -> dict:
        """Every actor rank calls it; see megarl.sync.weight_sync for which ranks gather and send.
        `version`: the servers' new weight_version (default the last one + 1); `flush`: per server,
        whether its KV cache is drained first (`WeightSync.push`). The metrics include
        `sync/weight_version`, the version the servers now hold."""
        from megarl.sync.adapter_sync import AdapterSync

        self.engine.offloader.check_onloaded(("params",))  # the push reads them
        adapters_only = isinstance(self.weight_sync, AdapterSync)
        with nullcontext() if adapters_only else self.engine.weights_for_sync():  # LoRA merged: base + s B A
            metrics = self.weight_sync.push(version, flush=flush)
        return {**metrics, "sync/weight_version": float(self.weight_sync.version)}
