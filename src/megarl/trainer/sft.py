"""Supervised fine-tuning on the Megatron engine: warm-up before RL, or a user's own SFT stage.

    python -m megarl.trainer.main_sft --config X.yaml data.train_files=sft_train.parquet ...

Data: verl parquet rows with a reference response column (`data.response_key`), or chats (a column
of messages, `data.messages_key`: verl's multi-turn SFT data, trained on the assistant turns,
megarl.data.conversations). Each step trains on `data.train_batch_size` examples (one optimizer
step, token-mean NLL of the trained tokens);
every `trainer.test_freq` steps the validation NLL is logged. At the end the actor is exported as
an HF checkpoint to `<default_local_dir>/<project>/<experiment>/hf`, which an RL run can start from.

Checkpoints and resume: megarl.trainer.offline (verl's `trainer.save_freq`, `resume_mode`).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from megarl import checkpoint
from megarl.config import ExperimentConfig
from megarl.data.batch import Batch
from megarl.data.conversations import Chat, ChatDataset
from megarl.data.prompts import Prompt, PromptDataset
from megarl.data.sampler import EpochSampler
from megarl.placement.from_config import offline_plan
from megarl.placement.ray_pools import create_pools
from megarl.trainer.offline import fit_offline, run_offline
from megarl.runtime.devices import resolve_devices
from megarl.runtime.roles import SFTActorRole


def sft_dataset(config: ExperimentConfig, tokenizer, files) -> PromptDataset | ChatDataset:
    d = config.data
    if d.messages_key is not None:
        return ChatDataset(files, tokenizer, messages_key=d.messages_key, max_length=d.max_length,
                           truncation=d.truncation, ignore_input_ids_mismatch=d.ignore_input_ids_mismatch,
                           chat_template_kwargs=d.apply_chat_template_kwargs)
    return PromptDataset(files, tokenizer, prompt_key=d.prompt_key, reward_fn_key=d.reward_fn_key,
                         response_key=d.response_key, max_prompt_length=d.max_prompt_length,
                         max_response_length=d.max_response_length, filter_overlong_prompts=d.filter_overlong_prompts,
                         truncation=d.truncation, chat_template_kwargs=d.apply_chat_template_kwargs)


def with_schedule_steps(config: ExperimentConfig, steps: int) -> ExperimentConfig:
    """`config` with the actor's optim.total_training_steps (the learning-rate schedule's length) set to
    the run's `steps` where it is not set (-1), as verl's SFT trainer sets it from its data."""
    arr = config.actor_rollout_ref
    if arr.actor.optim.total_training_steps > 0:
        return config
    optim = replace(arr.actor.optim, total_training_steps=steps)
    return replace(config, actor_rollout_ref=replace(arr, actor=replace(arr.actor, optim=optim)))


def as_batch(examples: list[Prompt] | list[Chat]) -> Batch:
    """The batch of SFT examples: prompt and reference response; a chat is split before its first
    trained token, its response_mask the loss mask over the rest (response_attention_mask: all of it)."""
    if not examples or isinstance(examples[0], Prompt):
        return Batch.from_token_lists([e.input_ids for e in examples], [e.response_ids for e in examples])
    cuts = [e.first_trained for e in examples]
    batch = Batch.from_token_lists([e.input_ids[:k] for e, k in zip(examples, cuts)],
                                   [e.input_ids[k:] for e, k in zip(examples, cuts)])
    batch["response_attention_mask"] = batch["response_mask"].clone()
    mask = batch["response_mask"]
    for row, (e, k) in enumerate(zip(examples, cuts)):
        mask[row, : len(e.input_ids) - k] = torch.tensor(e.loss_mask[k:], dtype=mask.dtype)
    batch["response_mask"] = mask
    return batch


class SFTTrainer:
    def __init__(self, config: ExperimentConfig, tokenizer):
        self.config = config
        self.train_data = sft_dataset(config, tokenizer, config.data.train_files)
        self.val_data = sft_dataset(config, tokenizer, config.data.val_files) if config.data.val_files else None
        self.sampler = EpochSampler.from_config(config.data, len(self.train_data))
        t = config.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.sampler.batches_per_epoch
        config = self.config = with_schedule_steps(config, self.total_steps)
        plan = offline_plan(config, with_ref=False)
        devices = resolve_devices(config)  # before any process starts
        self.pools = create_pools(plan, timeout_s=300)
        try:
            self.actor = SFTActorRole(plan.roles["actor"], self.pools, config, devices)
            self.checkpoints = checkpoint.Checkpoints(config, self.actor)
        except BaseException:
            self.pools.remove()
            raise

    def validation_nll(self) -> dict:
        """Token-mean NLL of the reference responses of the validation set (rounded down to a
        multiple of the data-parallel size)."""
        usable = len(self.val_data) - len(self.val_data) % self.actor.dp_size
        batch = as_batch(self.val_data.take(range(usable)))
        log_probs = self.actor.compute_log_prob(batch, 1.0)["log_probs"]
        mask = batch["response_mask"].bool()
        return {"val/nll": float(-log_probs[mask].mean())}

    def fit(self, tracker) -> dict:
        """Train to the last step (megarl.trainer.offline.fit_offline: resume, checkpoints, signals)."""
        return fit_offline(self, tracker, self.train_step, self.validation_nll if self.val_data is not None else None)

    def train_step(self) -> dict:
        """One optimizer step on the sampler's next batch; its metrics."""
        start = time.perf_counter()
        metrics = self.actor.sft_step(as_batch(self.train_data.take(self.sampler.next_batch())))
        metrics["timing/step_s"] = time.perf_counter() - start
        return metrics

    def export(self, out_dir: Path) -> Path:
        self.actor.export_hf(str(out_dir))
        return out_dir

    def shutdown(self) -> None:
        self.actor.shutdown()
        self.pools.remove()


def run_sft(config: ExperimentConfig) -> Path:
    """Train, export the HF checkpoint; returns its directory."""
    return run_offline(config, SFTTrainer, "fine-tuned")
