"""Everything the loops drive, brought up from a plan: the training roles' engine groups, the
rollout fleet, and the weight sync between them; the phases of a step over them; checkpoints
across roles.

A step, as `RLTrainer.train_step` calls it (the phases of `placement.colocated_memory.COLOCATED_ORDER`):

    generate(prompts, ...)   the rollout servers generate (dead or hung servers restarted first)
    training_phase()         colocated: the servers release their memory, offloaded roles come back
    ... the roles compute and update ...
    push_phase()             colocated: every planned training state but the actor's parameters
                             leaves the device, the servers' weights come back
    push_weights()           the actor's weights into every server as the next version
    rollout_phase()          colocated: the actor's parameters leave, the servers' KV cache comes back

Split placements run the same calls; their memory moves are empty. Every memory move, of a server
or a role, is one that `placement.colocated_memory.ColocatedMemory` (`self.memory`) gives, done
here and reported back to it: no other flag says what is where. Restarting rollout servers is this
module's too (`recover`: the memory a new server sizes itself from, a new weight sync, the current
weights, in that order); every phase restarts the servers it finds dead or hung and tries again
(`_with_recovery`); the fleet only finds, takes down, restarts and rejoins servers.

Colocated, the servers start first and release their memory (SGLang sizes its KV cache from the
memory free when it starts), then the engines initialise, then a first push gives the servers
their weights (version 0, the model the servers started from) and the planned roles offload
before the servers resume their KV cache.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

# Ray reads its auth mode when it is imported: set the default for a cluster started here first.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray  # noqa: E402

from megarl import checkpoint  # noqa: E402
from megarl.config import ExperimentConfig  # noqa: E402
from megarl.placement import format_gpu_map, plan_from_config  # noqa: E402
from megarl.placement.colocated_memory import ColocatedMemory, Moves  # noqa: E402
from megarl.placement.colocation import offload_plan, releases_server_memory  # noqa: E402
from megarl.placement.gpu_order import real_server_gpus  # noqa: E402
from megarl.placement.ray_pools import create_pools  # noqa: E402
from megarl.placement.worker_group import WorkerGroupError  # noqa: E402
from megarl.rollout.client import RolloutResult  # noqa: E402
from megarl.rollout.control import ServerError  # noqa: E402
from megarl.rollout.launch import rollout_api_key, server_startup_timeout_s  # noqa: E402
from megarl.rollout.protocol import SamplingParams  # noqa: E402
from megarl.sync.adapter_sync import served_adapter  # noqa: E402
from megarl.sync.colocation import ColocationError, colocated_peers  # noqa: E402
from megarl.sync.fp8_checkpoint import write_rollout_checkpoint  # noqa: E402
from megarl.sync.weight_sync import SyncConfig  # noqa: E402
from megarl.runtime.devices import resolve_devices  # noqa: E402
from megarl.runtime.roles import (  # noqa: E402
    ActorRole,
    CriticRole,
    RefRole,
    RewardModelRole,
    TeacherRole,
    TrainingRole,
    profile_step,
)
from megarl.runtime.rollout_fleet import GenerationInterrupted, RolloutFleet  # noqa: E402

log = logging.getLogger("megarl.runtime")
T = TypeVar("T")


def connect_ray(config: ExperimentConfig) -> None:
    """Join the running Ray cluster (RAY_ADDRESS or `ray start` on this node), or start a local one
    with the config's logical GPUs when there is none (one machine, e.g. the CPU quickstart).
    `trainer.worker_env` becomes the job's runtime_env, whose env_vars Ray merges into every actor's
    own (Ray's runtime-env inheritance, ray-project/ray#16378)."""
    if ray.is_initialized():
        if config.trainer.worker_env:
            raise RuntimeError(f"trainer.worker_env={config.trainer.worker_env}: Ray was started in this process "
                               "before the run, so its job environment cannot take them; let the run start Ray")
        return
    runtime_env = {"env_vars": dict(config.trainer.worker_env)} if config.trainer.worker_env else None
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING", runtime_env=runtime_env)
        return
    total = config.trainer.nnodes * config.trainer.n_gpus_per_node
    if config.trainer.nnodes > 1:
        raise RuntimeError(f"trainer.nnodes={config.trainer.nnodes}: start a Ray cluster first (launch/ or "
                           "slurm/megarl.sbatch) and set RAY_ADDRESS")
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), num_gpus=total, include_dashboard=False,
             log_to_driver=False, logging_level="WARNING", runtime_env=runtime_env)


class Cluster:
    def __init__(self, config: ExperimentConfig):
        self.config = config
        self.devices = resolve_devices(config)  # before any process starts: an impossible combination raises here
        log.info("devices: %s", self.devices.summary())
        self.plan = plan_from_config(config)
        log.info("placement:\n%s", format_gpu_map(self.plan))
        self.pools = create_pools(self.plan, timeout_s=300)
        self.num_gpus = self.plan.cluster.nnodes * self.plan.cluster.gpus_per_node
        self.colocated = config.placement.mode == "colocate"
        self.releases_memory = releases_server_memory(config)  # colocated, servers freed while training
        self.api_key = rollout_api_key(config.actor_rollout_ref.rollout.api_key_env)  # servers' and router's; never logged
        self.actor: ActorRole | None = None
        self.ref: RefRole | None = None
        self.critic: CriticRole | None = None
        self.reward_model: RewardModelRole | None = None
        self.teacher: TeacherRole | None = None  # on-policy distillation's Megatron teacher (megarl.trainer.teacher)
        self.rollout: RolloutFleet | None = None
        self.rollout_fp8: tuple[str, frozenset[str]] | None = None  # rollout.quantization=fp8: `_write_rollout_fp8`
        self.weight_version = 0  # of the last push into the rollout servers (0: none yet)
        # what each role offloads ({role: OffloadParts}, colocated only) and where every memory is now
        self.memory = ColocatedMemory(self.plan.roles["rollout"].dp, offload_plan(config, self.plan.roles),
                                      self.releases_memory)
        self._offload_totals = dict.fromkeys(("offload_s", "onload_s", "offload_bytes", "offload_freed_bytes"), 0.0)
        try:
            roles = self.plan.roles
            self.rollout_fp8 = self._write_rollout_fp8()
            if self.colocated:  # the servers size their memory before the engines take theirs
                self._start_rollout(roles["rollout"])
                self._do(self.memory.before_training())  # servers release what they hold; no role exists yet
            d = self.devices
            self.actor = ActorRole(roles["actor"], self.pools, config, d)
            self.ref = RefRole(roles["ref"], self.pools, config, d) if "ref" in roles else None
            self.critic = CriticRole(roles["critic"], self.pools, config, d) if "critic" in roles else None
            self.checkpoints = checkpoint.Checkpoints(config, self.actor, self.critic)
            self.reward_model = (RewardModelRole(roles["reward_model"], self.pools, config, d)
                                 if "reward_model" in roles else None)
            self.teacher = TeacherRole(roles["teacher"], self.pools, config, d) if "teacher" in roles else None
            if not self.colocated:
                self._start_rollout(roles["rollout"])
            self._make_sync()
            if self.colocated:  # the servers get version 0 (and their memory back if released), the engines make room
                self._push(version=self.weight_version)
                self.step_metrics()  # start-up moves and counts are not a step's
        except BaseException:
            self.shutdown()
            raise

    def _write_rollout_fp8(self) -> tuple[str, frozenset[str]] | None:
        """rollout.quantization=fp8: the servers' first checkpoint, the actor's HF model in block FP8
        (`sync.fp8_checkpoint`, under trainer.default_local_dir, which every server's node must see),
        as (its path, the HF weights every push quantizes); None otherwise."""
        r = self.config.actor_rollout_ref.rollout
        if r.quantization != "fp8":
            return None
        out = Path(self.config.trainer.default_local_dir) / "rollout_fp8"
        plan = write_rollout_checkpoint(self.config.actor_rollout_ref.model.path, out, r.tensor_model_parallel_size,
                                        r.expert_parallel_size)
        log.info("FP8 rollout: the servers start from %s (%d weights in block FP8)", out, len(plan.quantized))
        return str(out), plan.quantized

    def _start_rollout(self, role) -> None:
        r = self.config.actor_rollout_ref.rollout
        self.rollout = RolloutFleet(role, self.pools, self.config, colocated=self.colocated, api_key=self.api_key,
                                    single_node=self.plan.cluster.nnodes == 1,
                                    startup_timeout_s=server_startup_timeout_s(r.name, r.server_startup_timeout_s),
                                    device=self.devices.device,
                                    model_path=self.rollout_fp8[0] if self.rollout_fp8 else None)

    def _make_sync(self) -> None:
        """A new weight sync over the fleet's servers (at start, and after servers restarted)."""
        r, transport = self.config.actor_rollout_ref.rollout, self.devices.weight_sync_transport
        fp8_path, fp8_weights = self.rollout_fp8 or (None, frozenset())
        sync_config = SyncConfig(
            transport=transport, backend=self.devices.weight_sync_backend,
            bucket_bytes=r.update_weights_bucket_megabytes * 2**20,
            # the disk transport's pushes take config.json from here: the FP8 checkpoint's has its quantization_config
            hf_assets_dir=fp8_path or self.config.actor_rollout_ref.model.path, fp8_weights=fp8_weights,
            check_weights=r.check_weight_update, weight_update_groups=r.weight_update_groups,
            group_timeout_s=self.config.actor_rollout_ref.nccl_timeout,
            disk_dir=str(Path(self.config.trainer.default_local_dir) / "weight_sync") if transport == "disk" else None,
            colocated_peers=self._colocated_peers() if transport == "tensor" else None,
        )
        self.actor.init_weight_sync(self.rollout.urls, sync_config, self.weight_version, self.api_key)

    def _colocated_peers(self) -> list[list[int]] | None:
        """Per server, per TP rank: the actor rank on that TP rank's real GPU, from the GPUs Ray gave
        the bundles (`placement.gpu_order`), not from the plan's order. None where no actor rank shares
        each server GPU (split pools): on CPU one shared copy then serves every server, on CUDA the
        transport refuses (a CUDA IPC handle opens only on its own GPU)."""
        rollout = self.plan.roles["rollout"]
        server_gpus = real_server_gpus(rollout, [self.pools.device_gpu(rollout.pool, i)
                                                 for i in range(rollout.world_size)])
        actor_gpus = [(g.node_id, g.index) for g in self.actor.workers.gpus]
        try:
            return colocated_peers(actor_gpus, server_gpus)
        except ColocationError:
            if self.devices.device == "cuda":
                raise
            return None

    # ------------------------------------------------------------------ generation and restarts
    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 seeds: list[int] | None = None) -> RolloutResult:
        """The fleet's `generate`, with the servers that died or hung restarted (`recover`): those
        found before it starts, and those whose death lost prompts, which are then sent again with
        their seeds. On the controller's thread only (a restart pushes weights)."""
        self.recover()
        partial = None
        while True:
            try:
                return self.rollout.generate(prompts, sampling, seeds, partial=partial)
            except GenerationInterrupted as cut:
                self.recover()
                partial = cut

    def recover(self, push_follows: bool = False) -> int:
        """Restart every rollout server that died or hung; returns how many. Only while nothing
        generates. In order: the fleet takes them down (hung ones killed, out of the router); the
        training roles free what they free for generation (`memory.before_restart`: a new server
        sizes its KV cache from what is free); the servers start again, holding all their memory
        (`memory.server_restarted`); a new weight sync over the server set (the old weight-update
        groups held the dead process); unless a push follows (`push_follows`: it sends every server
        the whole model), the actor's weights again at the current version, so restarted servers
        answer with the weights and version of the others; then they rejoin the router. Before the
        engines exist (a colocated start) only the restart: the first push follows."""
        dead = self.rollout.take_down_failed()
        if not dead:
            return 0
        if self.actor is not None:
            self._do(self.memory.before_restart())
        self.rollout.restart(dead)
        for server in dead:
            self.memory.server_restarted(server)
        if self.actor is not None:
            self._make_sync()
            if not push_follows and self.rollout.weight_version is not None:  # a push happened (colocated: at start)
                self._push(version=self.weight_version)
        self.rollout.rejoin(dead)
        return len(dead)

    def _with_recovery(self, what: str, attempt: Callable[[], T], push_follows: bool = False) -> T:
        """`attempt()`, again after the rollout servers that died or hung are restarted (within
        `max_server_restarts`; `push_follows`: `recover`'s), until it succeeds; its own error when
        every server is alive and answers (a retry would repeat it)."""
        while True:
            try:
                return attempt()
            except (WorkerGroupError, ServerError) as failed:
                if self.recover(push_follows) == 0:
                    raise
                first = str(failed).splitlines()[:2][-1].strip()  # the first line of the first rank, no traceback
                log.warning("%s failed as rollout servers died or hung; they were restarted, trying again. The "
                            "failure: %s", what, first)

    # ------------------------------------------------------------------ the phases of a step
    def training_phase(self) -> None:
        """Colocated: the servers that hold memory free it for training (unless
        `rollout.free_cache_engine` is false; a dead or hung one is restarted first), then every
        offloaded role comes back. A push always follows (the step's, a checkpoint's): a server
        restarted here gets only a new weight sync, and releases its memory with the others."""
        if self.releases_memory:
            self.recover(push_follows=True)
        self._with_recovery("releasing the rollout servers' memory", lambda: self._do(self.memory.before_training()),
                            push_follows=True)

    def push_phase(self) -> None:
        """Before the push (dead or hung servers restarted first, once the roles freed generation's
        memory): servers that hold memory (restarted, or all between generations) release it, the
        actor's parameters come on the device, the rest of the planned training states leave, the
        caches are emptied, the released servers' weights come back."""
        self.recover(push_follows=True)
        self._with_recovery("preparing the weight push", lambda: self._do(self.memory.before_push()),
                            push_follows=True)

    def push_weights(self, version: int | None = None) -> dict:
        """The actor's weights into every rollout server as `version` (default the next one; the
        current one re-gives the servers the weights they had), flushing only the servers whose KV
        cache is resident. Servers that die or hang during it are restarted and the push sent again
        (after `push_phase`'s moves again, only what is not done yet), so every server ends at the
        new version; a push that fails while every server is alive raises its own error at once.
        Returns the push metrics (the same on every rank)."""
        target = self.weight_version + 1 if version is None else version

        def push() -> dict:
            self._do(self.memory.before_push())
            return self.actor.push_weights(version, self.memory.flush_before_push())

        metrics = self._with_recovery(f"the weight push to version {target}", push, push_follows=True)
        self.weight_version = int(metrics["sync/weight_version"])
        self.rollout.weight_version = str(self.weight_version)
        self.rollout.client.lora_name = served_adapter(self.config, self.weight_version)
        return metrics

    def rollout_phase(self) -> None:
        """After the push: the actor's planned parameters leave too, the caches are emptied, the
        servers' KV cache and CUDA graphs come back. A server restarted here is given the current
        weights again (`recover`)."""
        self._with_recovery("resuming the rollout servers' KV cache", lambda: self._do(self.memory.after_push()))

    def _push(self, version: int | None = None) -> dict:
        """The push with its phases (`push_phase`, `push_weights`, `rollout_phase`) as one call: at
        start, around a checkpoint, after a restart. Returns the push metrics."""
        self.push_phase()
        metrics = self.push_weights(version)
        self.rollout_phase()
        return metrics

    def sync_weights(self) -> dict:
        """The push to the next version with its phases as one call, and the rollout fault counts
        since the last call (`faults/*`)."""
        return {**self._push(), **self.rollout.fault_metrics()}

    # ------------------------------------------------------------------ memory moves
    def _do(self, moves: Moves) -> None:
        """Carry out `moves` in their order (releases, onloads, offloads, the caches emptied, resumes)
        and report each to `memory` once done. Raises `ServerError` naming the servers whose
        release or resume failed (the others' moves are recorded)."""
        if moves.release:
            self._server_moves(moves.release, self.rollout.release_memory, self.memory.server_released)
        for role in moves.onload:
            stats = self._training_roles()[role].onload()
            self.memory.role_onloaded(role)
            self._offload_totals["onload_s"] += max(s["seconds"] for s in stats)
        for role, parts in moves.offload.items():
            stats = self._training_roles()[role].offload(parts.params, parts.grads, parts.optimizer)
            self.memory.role_offloaded(role, parts)
            self._offload_totals["offload_s"] += max(s["seconds"] for s in stats)
            self._offload_totals["offload_bytes"] += sum(s["bytes"] for s in stats)
            self._offload_totals["offload_freed_bytes"] += sum(s["freed_bytes"] for s in stats)
        if moves.empty_cache:  # SGLang's memory saver maps its memory again from what is physically free
            for role in self._training_roles().values():
                role.empty_cache()
        if moves.resume:
            self._server_moves(moves.resume, self.rollout.resume_memory, self.memory.server_resumed)

    @staticmethod
    def _server_moves(tags: dict[int, tuple[str, ...]], call, done) -> None:
        """`call(tags)` (the fleet's release or resume), `done(server, tags)` for each that succeeded;
        raise `ServerError` naming those that failed."""
        failed = call(tags)
        for server, server_tags in tags.items():
            if server not in failed:
                done(server, server_tags)
        if failed:
            raise ServerError("; ".join(failed.values()))

    def _training_roles(self) -> dict[str, TrainingRole]:
        """The training roles that run, by the plan's names of them."""
        roles = {"actor": self.actor, "ref": self.ref, "critic": self.critic, "reward_model": self.reward_model,
                 "teacher": self.teacher}
        return {name: role for name, role in roles.items() if role is not None}

    def profile_step(self, step: int) -> contextlib.AbstractContextManager:
        """verl's profiler around training step `step` on the training roles (`roles.profile_step`)."""
        return profile_step(self.config, self._training_roles(), step)

    def step_metrics(self) -> dict[str, float]:
        """Since the last call (once per step): `perf/offload_s`, `perf/onload_s` (wall seconds,
        the slowest rank of each role, roles one after the other), `perf/offload_bytes` (bytes
        copied to host memory, all ranks and roles), `perf/offload_freed_bytes` (device bytes
        released, copied or dropped gradients) and the rollout fault counts (`faults/*`). The
        counters restart."""
        out = {f"perf/{k}": float(v) for k, v in self._offload_totals.items()}
        self._offload_totals = dict.fromkeys(self._offload_totals, 0.0)
        return {**out, **self.rollout.fault_metrics()}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, root: Path, step: int, controller_state: dict) -> Path | None:
        """Every role's engine state plus the controller's, atomically (megarl.checkpoint.Checkpoints);
        its directory, or None while the actor's is written in the background (async_save: committed
        by a later `checkpoints.poll` or `checkpoints.finish`). Offloaded roles come back for it: the
        servers release their memory first, and a push at the current version gives them their
        weights back afterwards (the background write has its own copy of the tensors by then)."""
        offloaded = any(parts.any() for parts in self.memory.offloaded.values())
        if offloaded:
            self.training_phase()
        saved = self.checkpoints.save(root, step, controller_state)
        if offloaded:
            self._push(version=self.weight_version)
        return saved

    def load_checkpoint(self, directory: Path) -> dict:
        """Restore the engines from `directory`, push the weights to the servers; returns the
        controller state. A background write of this run is committed first."""
        self.checkpoints.finish()
        self.training_phase()  # offloaded roles come back (the servers release their memory first)
        self.actor.load_checkpoint(str(directory / "actor"), checkpoint.loads_optimizer(self.config, directory))
        if self.critic is not None:
            self.critic.load_checkpoint(str(directory / "critic"),
                                        checkpoint.loads_optimizer(self.config, directory, "critic"))
        self._push()
        return checkpoint.load_controller_state(directory)

    def shutdown(self) -> None:
        for name in ("rollout", "teacher", "reward_model", "critic", "ref", "actor"):
            part = getattr(self, name)
            if part is not None:
                try:
                    part.shutdown()
                except Exception:  # keep tearing down the rest
                    log.exception("shutting down %s failed", name)
                setattr(self, name, None)
        if getattr(self, "pools", None) is not None:
            self.pools.remove()
            self.pools = None
