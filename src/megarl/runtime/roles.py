"""The controller's typed handles on the training roles: one class per role, whose methods the
trainers call (`actor.update_policy(batch)`, `ref.compute_ref_log_prob(batch, t)`). Each is a
one-line forward through its `EngineGroup` to the `TrainWorker` method of the same name, which
runs the engine's (megarl.engines.megatron.roles): a reader or an IDE follows a batch from the
trainer into the engine by name, and renaming an engine method is a rename, not a grep.

Per-sample computations come back joined over the DP ranks (`EngineGroup.compute`), updates as
rank 0's metrics (`EngineGroup.update`). A new role is one more class here (and its engine's
methods on `TrainWorker`).
"""
from __future__ import annotations

import torch

from megarl.data.batch import Batch
from megarl.runtime.engine_group import EngineGroup
from megarl.workers.train_worker import TrainWorker


class TrainingRole(EngineGroup):
    """What every training role's engine does: memory moves (colocated) and checkpoints."""

    def offload(self, params: bool, grads: bool, optimizer: bool) -> list[dict]:
        """The chosen parts off the device; per rank, `MegatronEngine.offload`'s stats."""
        return self.call(TrainWorker.offload, params=params, grads=grads, optimizer=optimizer)

    def onload(self) -> list[dict]:
        """What `offload` moved, back; per rank, `MegatronEngine.onload`'s stats."""
        return self.call(TrainWorker.onload)

    def empty_cache(self) -> list[dict]:
        return self.call(TrainWorker.empty_cache)

    def save_checkpoint(self, path: str) -> None:
        self.call(TrainWorker.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> None:
        self.call(TrainWorker.load_checkpoint, path)


class ActorRole(TrainingRole):
    """The RL policy (`ActorEngine`) and its weight push into the rollout servers."""

    def compute_log_prob(self, batch: Batch, temperature: float,
                         with_entropy: bool = False) -> dict[str, torch.Tensor]:
        return self.compute(TrainWorker.compute_log_prob, batch, temperature, with_entropy)

    def update_policy(self, batch: Batch) -> dict[str, float]:
        return self.update(TrainWorker.update_policy, batch)

    def update_policy_with_old_log_probs(self, batch: Batch) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        return self.update_and_compute(TrainWorker.update_policy_with_old_log_probs, batch)

    def init_weight_sync(self, server_urls: list[str], sync_config, version: int, api_key: str | None) -> None:
        self.workers.call(TrainWorker.init_weight_sync, server_urls, sync_config, version, api_key, timeout_s=600)

    def push_weights(self, version: int | None, flush: list[bool] | None) -> dict[str, float]:
        """The push's metrics (the same on every rank: rank 0's)."""
        return self.workers.call(TrainWorker.push_weights, version, flush, timeout_s=3600)[0]


class SFTActorRole(TrainingRole):
    """The policy fine-tuned on reference responses (megarl.trainer.sft)."""

    def compute_log_prob(self, batch: Batch, temperature: float) -> dict[str, torch.Tensor]:
        return self.compute(TrainWorker.compute_log_prob, batch, temperature)

    def sft_step(self, batch: Batch) -> dict[str, float]:
        return self.update(TrainWorker.sft_step, batch)

    def export_hf(self, out_dir: str) -> None:
        self.call(TrainWorker.export_hf, out_dir)


class DPOActorRole(TrainingRole):
    """The policy trained on preference pairs (megarl.trainer.dpo)."""

    def dpo_step(self, batch: Batch) -> dict[str, float]:
        return self.update(TrainWorker.dpo_step, batch)

    def dpo_eval(self, batch: Batch) -> dict[str, float]:
        return self.update(TrainWorker.dpo_eval, batch)

    def export_hf(self, out_dir: str) -> None:
        self.call(TrainWorker.export_hf, out_dir)


class RefRole(TrainingRole):
    """The frozen reference policy (`RefEngine`)."""

    def compute_ref_log_prob(self, batch: Batch, temperature: float) -> dict[str, torch.Tensor]:
        return self.compute(TrainWorker.compute_ref_log_prob, batch, temperature)


class CriticRole(TrainingRole):
    """PPO's value model (`CriticEngine`)."""

    def compute_values(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.compute(TrainWorker.compute_values, batch)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self.update(TrainWorker.update_critic, batch)


class RewardModelRole(TrainingRole):
    """A sequence-classification reward model (`RewardModelEngine`), forward only."""

    def compute_rm_scores(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.compute(TrainWorker.compute_rm_scores, batch)


class TeacherRole(TrainingRole):
    """On-policy distillation's frozen Megatron teacher (`TeacherEngine`, megarl.trainer.teacher)."""

    def compute_teacher_log_prob(self, batch: Batch, temperature: float) -> dict[str, torch.Tensor]:
        return self.compute(TrainWorker.compute_teacher_log_prob, batch, temperature)
