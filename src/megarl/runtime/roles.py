"""The controller's typed handles on the training roles: one class per role, whose methods the
trainers call (`actor.update_policy(batch)`, `ref.compute_ref_log_prob(batch, t)`). Each names the
engine method it runs once, `ActorEngine.update_policy`: `EngineGroup` sends that name to every
rank's `TrainWorker.run_engine`, which runs the method on the rank's engine
(megarl.engines.megatron) after checking it is a public method of the engine's class. A reader or
an IDE follows the name into the engine; renaming an engine method is a rename, not a grep.

Megatron loads in the workers only: here the engine classes are imported for a type checker or an
IDE, and at run time are `EngineClass`es, whose attributes are the methods' names.

Per-sample computations come back joined over the DP ranks (`EngineGroup.compute`), updates as
rank 0's metrics (`EngineGroup.update`). A new role is one more class here (and its engine in
`megarl.workers.train_worker.engine_class`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from megarl.config.profiler import profiled_roles
from megarl.data.batch import Batch
from megarl.runtime.engine_group import EngineClass, EngineGroup
from megarl.workers.train_worker import TrainWorker

if TYPE_CHECKING:
    from megarl.engines.megatron.engine import MegatronEngine
    from megarl.engines.megatron.reward_model import RewardModelEngine
    from megarl.engines.megatron.roles import ActorEngine, CriticEngine, RefEngine, TeacherEngine
else:
    MegatronEngine = EngineClass("MegatronEngine")
    ActorEngine = EngineClass("ActorEngine")
    RefEngine = EngineClass("RefEngine")
    CriticEngine = EngineClass("CriticEngine")
    RewardModelEngine = EngineClass("RewardModelEngine")
    TeacherEngine = EngineClass("TeacherEngine")

log = logging.getLogger("megarl.runtime")


class TrainingRole(EngineGroup):
    """What every training role's engine does: memory moves (colocated) and checkpoints."""

    def offload(self, params: bool, grads: bool, optimizer: bool) -> list[dict]:
        """The chosen parts off the device; per rank, `MegatronEngine.offload`'s stats."""
        return self.call(MegatronEngine.offload, params=params, grads=grads, optimizer=optimizer)

    def onload(self) -> list[dict]:
        """What `offload` moved, back; per rank, `MegatronEngine.onload`'s stats."""
        return self.call(MegatronEngine.onload)

    def empty_cache(self) -> list[dict]:
        """The caching allocator's unused device memory given back; per rank, its stats."""
        return self.call(MegatronEngine.empty_cache)

    def save_checkpoint(self, path: str, optimizer: bool = True, background: bool = False) -> None:
        self.call(MegatronEngine.save_checkpoint, path, optimizer, background)

    def finish_saves(self, blocking: bool, timeout_s: float) -> bool:
        """Whether no background write is left (the ranks agree: `MegatronEngine.finish_saves`)."""
        return all(self.call(MegatronEngine.finish_saves, blocking, timeout_s))

    def load_checkpoint(self, path: str, optimizer: bool = True) -> None:
        self.call(MegatronEngine.load_checkpoint, path, optimizer)

    def start_profile(self, step: int) -> None:
        """Every rank starts recording step `step` if its profiler selects it (`TrainWorker.start_profile`)."""
        self.workers.call(TrainWorker.start_profile, step, timeout_s=60)

    def stop_profile(self) -> list[str]:
        """The trace files the ranks wrote (`TrainWorker.stop_profile`)."""
        return [path for path in self.workers.call(TrainWorker.stop_profile, timeout_s=600) if path]


@contextlib.contextmanager
def profile_step(config, roles: Mapping[str, TrainingRole], step: int) -> Iterator[None]:
    """verl's profiler around training step `step` (from 1, verl's global_steps) of a loop whose
    training roles are `roles` (by role name): when it is one of global_profiler.steps, each role
    whose `profiler.enable` is set records it on its selected ranks (megarl.workers.profiling.StepTrace)
    and writes the traces under global_profiler.save_path."""
    profiled = [role for name, role in roles.items() if name in profiled_roles(config, step)]
    for role in profiled:
        role.start_profile(step)
    yield  # a step that raises ends the loop: its traces are not written
    for role in profiled:
        for path in role.stop_profile():
            log.info("step %d: %s trace written to %s", step, role.name, path)


class ActorRole(TrainingRole):
    """The RL policy (`ActorEngine`) and its weight push into the rollout servers (the worker's own)."""

    def compute_log_prob(self, batch: Batch, temperature: float,
                         with_entropy: bool = False) -> dict[str, torch.Tensor]:
        return self.compute(ActorEngine.compute_log_prob, batch, temperature, with_entropy)

    def compute_log_prob_at(self, batch: Batch, temperature: float, ids_key: str) -> dict[str, torch.Tensor]:
        return self.compute(ActorEngine.compute_log_prob_at, batch, temperature, ids_key)

    def update_policy(self, batch: Batch) -> dict[str, float]:
        return self.update(ActorEngine.update_policy, batch)

    def update_policy_with_old_log_probs(self, batch: Batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        return self.update_and_compute(ActorEngine.update_policy_with_old_log_probs, batch)

    def init_weight_sync(self, server_urls: list[str], sync_config, version: int, api_key: str | None) -> None:
        self.workers.call(TrainWorker.init_weight_sync, server_urls, sync_config, version, api_key, timeout_s=600)

    def push_weights(self, version: int | None, flush: list[bool] | None) -> dict[str, float]:
        """The push's metrics (the same on every rank: rank 0's)."""
        return self.workers.call(TrainWorker.push_weights, version, flush, timeout_s=3600)[0]


class SFTActorRole(TrainingRole):
    """The policy fine-tuned on reference responses (megarl.trainer.sft)."""

    def compute_log_prob(self, batch: Batch, temperature: float) -> dict[str, torch.Tensor]:
        return self.compute(ActorEngine.compute_log_prob, batch, temperature)

    def sft_step(self, batch: Batch) -> dict[str, float]:
        return self.update(ActorEngine.sft_step, batch)

    def export_hf(self, out_dir: str) -> None:
        self.call(ActorEngine.export_hf, out_dir)


class DPOActorRole(TrainingRole):
    """The policy trained on preference pairs (megarl.trainer.dpo)."""

    def dpo_step(self, batch: Batch) -> dict[str, float]:
        return self.update(ActorEngine.dpo_step, batch)

    def dpo_eval(self, batch: Batch) -> dict[str, float]:
        return self.update(ActorEngine.dpo_eval, batch)

    def export_hf(self, out_dir: str) -> None:
        self.call(ActorEngine.export_hf, out_dir)


class RefRole(TrainingRole):
    """The frozen reference policy (`RefEngine`)."""

    def compute_ref_log_prob(self, batch: Batch, temperature: float) -> dict[str, torch.Tensor]:
        return self.compute(RefEngine.compute_ref_log_prob, batch, temperature)


class CriticRole(TrainingRole):
    """PPO's value model (`CriticEngine`)."""

    def compute_values(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.compute(CriticEngine.compute_values, batch)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.update(CriticEngine.update_critic, batch)


class RewardModelRole(TrainingRole):
    """A sequence-classification reward model (`RewardModelEngine`), forward only."""

    def compute_rm_scores(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.compute(RewardModelEngine.compute_rm_scores, batch)


class TeacherRole(TrainingRole):
    """On-policy distillation's frozen Megatron teacher (`TeacherEngine`, megarl.trainer.teacher)."""

    def compute_teacher_log_prob(self, batch: Batch, temperature: float) -> dict[str, torch.Tensor]:
        return self.compute(TeacherEngine.compute_teacher_log_prob, batch, temperature)

    def compute_teacher_top_k(self, batch: Batch, temperature: float, k: int) -> dict[str, torch.Tensor]:
        return self.compute(TeacherEngine.compute_teacher_top_k, batch, temperature, k)
