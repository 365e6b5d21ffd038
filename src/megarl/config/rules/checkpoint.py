"""Rules on what the actor's checkpoints hold (`actor_rollout_ref.actor.checkpoint`, verl's keys:
verl/trainer/config/config.py CheckpointConfig, verl/utils/checkpoint/megatron_checkpoint_manager.py)."""
from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig

KEY = "actor_rollout_ref.actor.checkpoint"
CONTENTS = ("model", "optimizer", "extra", "hf_model")  # verl's names (CheckpointConfig.save_contents)


def async_save_problem(async_save: bool, start_methods: Sequence[str]) -> Optional[str]:
    """Why `checkpoint.async_save` cannot run, or None; `start_methods`: this machine's
    multiprocessing start methods (multiprocessing.get_all_start_methods()). megarl writes in the
    background as verl's MegatronCheckpointManager does, with megatron-core's AsyncCallsQueue, whose
    writer is a forked process (dist_checkpointing/strategies/async_utils.py TemporalAsyncCaller:
    mp.get_context('fork')) on GPUs and CPUs alike; the checkpoint is committed once every rank's write
    finished (megarl.checkpoint.Checkpoints). Where processes cannot fork, the writer cannot start."""
    if not async_save or "fork" in start_methods:
        return None
    return (f"{KEY}.async_save=true: megatron-core's background checkpoint writer is a forked process "
            "(dist_checkpointing/strategies/async_utils.py TemporalAsyncCaller) and this machine's Python cannot "
            f"fork (start methods {list(start_methods)}); use async_save=false")


def checkpoint_contents(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """`save_contents` names verl's parts only (model, optimizer, extra, hf_model) and holds the
    model: megarl resumes from its checkpoints, which needs the weights (verl saves none without it
    and then resumes from the initial weights). Without optimizer the checkpoint holds the weights
    alone and a resume starts a fresh optimizer and learning-rate schedule, as verl's
    (load_contents defaults to save_contents); hf_model adds an HF copy. `async_save`: async_save_problem.

    Reads: actor_rollout_ref.actor.checkpoint
    """
    c = config.actor_rollout_ref.actor.checkpoint
    unknown = [name for name in c.save_contents if name not in CONTENTS]
    if unknown:
        yield f"{KEY}.save_contents={c.save_contents}: {unknown} not among verl's parts {list(CONTENTS)}"
    elif "model" not in c.save_contents:
        yield (f"{KEY}.save_contents={c.save_contents}: megarl's checkpoints always hold the model (a checkpoint is "
               "what a run resumes from, and that needs the weights); add model")
    problem = async_save_problem(c.async_save, multiprocessing.get_all_start_methods())
    if problem:
        yield problem


def checkpoint_without_extra(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A warning: without `extra` (verl: the ranks' RNG states) megarl still saves the trainer's own
    state (controller.pt: step, data position, RNG), which resuming needs.

    Reads: actor_rollout_ref.actor.checkpoint.save_contents
    """
    c = config.actor_rollout_ref.actor.checkpoint
    if "extra" not in c.save_contents and "model" in c.save_contents:
        yield (f"{KEY}.save_contents={c.save_contents} without extra: megarl's checkpoints still hold the trainer's "
               "state (step, data position, RNG: controller.pt, kilobytes), which resuming needs")
