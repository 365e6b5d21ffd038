"""Direct preference optimisation on the Megatron engine (Rafailov et al., 2023), offline.

    python -m megarl.trainer.main_dpo --config X.yaml data.train_files=prefs_train.parquet ...

Data: verl parquet rows with a chosen and a rejected response (`data.chosen_key`,
`data.rejected_key`; see megarl.data.preferences). Each step takes `data.train_batch_size` pairs:

    pairs -> frozen reference's log-probs (RefEngine, forward only) -> one DPO optimizer step of the
    policy (ActorEngine.dpo_step: loss of `algorithm.dpo`) -> log -> validate every test_freq

Validation (before training with trainer.val_before_train, every `trainer.test_freq` steps and at
the end) computes the same metrics on `data.val_files` without an update; the reference's
validation log-probs are computed once. At the end the policy is exported as an HF checkpoint to
`<default_local_dir>/<project>/<experiment>/hf`. Policy and reference share the training GPUs.

Checkpoints and resume: megarl.trainer.offline (verl's `trainer.save_freq`, `resume_mode`), the
policy's as SFT's. The frozen reference is not saved: every run builds it from
`actor_rollout_ref.model.path` (or `ref.megatron.dist_checkpointing_path`) as RefEngine does, the same
weights after a resume as before it (verl's checkpoints hold no reference either: ray_trainer.py
`_save_checkpoint` saves the actor and critic). A resumed run validates before training only when it
starts at step 0, as the RL trainer.
"""
from __future__ import annotations

import time
from pathlib import Path

from megarl.config import ConfigError, ExperimentConfig
from megarl.data.batch import Batch
from megarl.data.preferences import PreferenceDataset, pairs_to_batch
from megarl.data.sampler import EpochSampler
from megarl.placement.from_config import offline_plan
from megarl.placement.ray_pools import create_pools
from megarl import checkpoint
from megarl.trainer.offline import fit_offline, run_offline
from megarl.runtime.devices import resolve_devices
from megarl.runtime.roles import DPOActorRole, RefRole


class DPOTrainer:
    def __init__(self, config: ExperimentConfig, tokenizer):
        self.config = config
        self.train_data = PreferenceDataset.from_config(config.data, tokenizer, "train")
        self.val_data = PreferenceDataset.from_config(config.data, tokenizer, "val") if config.data.val_files else None
        self.sampler = EpochSampler.from_config(config.data, len(self.train_data))
        t = config.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.sampler.batches_per_epoch
        plan = offline_plan(config, with_ref=True)
        for role in ("actor", "ref"):
            if config.data.train_batch_size % plan.roles[role].dp:
                raise ConfigError(
                    f"data.train_batch_size={config.data.train_batch_size} pairs do not split over the {role}'s "
                    f"data-parallel size {plan.roles[role].dp}: every rank needs whole pairs"
                )
        devices = resolve_devices(config)  # before any process starts
        self.pools = create_pools(plan, timeout_s=300)
        self.actor = self.ref = None
        try:
            self.actor = DPOActorRole(plan.roles["actor"], self.pools, config, devices)
            self.ref = RefRole(plan.roles["ref"], self.pools, config, devices)
            self.checkpoints = checkpoint.Checkpoints(config, self.actor)
        except BaseException:
            self.shutdown()
            raise
        self._val_batch: Batch | None = None

    def with_ref_log_probs(self, batch: Batch) -> Batch:
        """`batch` plus the frozen reference's per-token `ref_log_probs` [B, R] (temperature 1)."""
        batch["ref_log_probs"] = self.ref.compute_ref_log_prob(batch, 1.0)["ref_log_probs"]
        return batch

    def validate(self) -> dict[str, float]:
        """`val/dpo_<metric>` on the validation pairs (rounded down to a multiple of the DP size),
        without an update."""
        if self._val_batch is None:
            usable = len(self.val_data) - len(self.val_data) % self.actor.dp_size
            if usable == 0:
                raise ConfigError(f"data.val_files hold {len(self.val_data)} pairs, fewer than the actor's "
                                  f"data-parallel size {self.actor.dp_size}")
            self._val_batch = self.with_ref_log_probs(pairs_to_batch(self.val_data.take(range(usable))))
        metrics = self.actor.dpo_eval(self._val_batch)
        return {f"val/dpo_{name}": value for name, value in metrics.items()}

    def fit(self, tracker) -> dict:
        """Train to the last step (megarl.trainer.offline.fit_offline: resume, checkpoints, signals)."""
        validating = self.val_data is not None and self.config.trainer.test_freq > 0
        return fit_offline(self, tracker, self.train_step, self.validate if validating else None,
                           validate_first=self.config.trainer.val_before_train)

    def train_step(self) -> dict:
        """The reference's log-probs and one DPO optimizer step on the sampler's next pairs; its metrics."""
        start = time.perf_counter()
        batch = pairs_to_batch(self.train_data.take(self.sampler.next_batch()))
        self.with_ref_log_probs(batch)
        ref_done = time.perf_counter()
        metrics = self.actor.dpo_step(batch)
        done = time.perf_counter()
        metrics.update({"timing/ref_log_prob_s": ref_done - start, "timing/update_actor_s": done - ref_done,
                        "timing/step_s": done - start})
        return metrics

    def export(self, out_dir: Path) -> Path:
        self.actor.export_hf(str(out_dir))
        return out_dir

    def shutdown(self) -> None:
        for group in (self.ref, self.actor):
            if group is not None:
                group.shutdown()
        self.actor = self.ref = None
        self.pools.remove()


def run_dpo(config: ExperimentConfig) -> Path:
    """Train, export the HF checkpoint; returns its directory."""
    return run_offline(config, DPOTrainer, "DPO-trained")
