"""Rules on what the actor's checkpoints hold (`actor_rollout_ref.actor.checkpoint`, verl's keys:
verl/trainer/config/config.py CheckpointConfig, verl/utils/checkpoint/megatron_checkpoint_manager.py)."""
from __future__ import annotations

import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import CheckpointConfig, ExperimentConfig

KEY = "actor_rollout_ref.actor.checkpoint"
CRITIC_KEY = "critic.checkpoint"
CONTENTS = ("model", "optimizer", "extra", "hf_model")  # verl's names (CheckpointConfig.save_contents)


def async_save_problem(async_save: bool, start_methods: Sequence[str], key: str = KEY) -> Optional[str]:
    """Why `checkpoint.async_save` cannot run, or None; `start_methods`: this machine's
    multiprocessing start methods (multiprocessing.get_all_start_methods()). megarl writes in the
    background as verl's MegatronCheckpointManager does, with megatron-core's AsyncCallsQueue, whose
    writer is a forked process (dist_checkpointing/strategies/async_utils.py TemporalAsyncCaller:
    mp.get_context('fork')) on GPUs and CPUs alike; the checkpoint is committed once every rank's write
    finished (megarl.checkpoint.Checkpoints). Where processes cannot fork, the writer cannot start."""
    if not async_save or "fork" in start_methods:
        return None
    return (f"{key}.async_save=true: megatron-core's background checkpoint writer is a forked process "
            "(dist_checkpointing/strategies/async_utils.py TemporalAsyncCaller) and this machine's Python cannot "
            f"fork (start methods {list(start_methods)}); use async_save=false")


def _sections(config: ExperimentConfig) -> list[tuple[str, CheckpointConfig]]:
    """(key, checkpoint config) of the roles that save checkpoints: the actor, and the critic where it
    runs (a critic that does not run saves nothing, its keys read by no one, as in verl)."""
    sections = [(KEY, config.actor_rollout_ref.actor.checkpoint)]
    return sections + ([(CRITIC_KEY, config.critic.checkpoint)] if config.critic.enable else [])


def _contents_problems(key: str, contents: list[str], what: str) -> Iterator[str]:
    """Why a `save_contents` / `load_contents` list (`what`) cannot run: a name not among verl's
    parts, or no model (a checkpoint is what a run resumes from, and that needs the weights; verl
    saves none without it, and loads none, resuming from the initial weights)."""
    unknown = [name for name in contents if name not in CONTENTS]
    if unknown:
        yield f"{key}.{what}={contents}: {unknown} not among verl's parts {list(CONTENTS)}"
    elif "model" not in contents:
        yield (f"{key}.{what}={contents}: megarl's checkpoints always {'hold' if what == 'save_contents' else 'load'} "
               "the model (a checkpoint is what a run resumes from, and that needs the weights); add model")


def checkpoint_contents(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """`save_contents` and `load_contents` (of the actor and the critic) name verl's parts only
    (model, optimizer, extra, hf_model) and hold the model (_contents_problems). Without optimizer
    the checkpoint holds the weights alone and a resume starts a fresh optimizer and learning-rate
    schedule, as verl's; load_contents without optimizer starts a fresh one from a checkpoint holding
    one (megarl.checkpoint.loads_optimizer); hf_model adds an HF copy of the actor (verl writes the
    critic's through Megatron-Bridge, megarl has no HF layout for a critic's value head), and in
    load_contents loads the same weights, which megarl reads from the sharded checkpoint.
    Each role's `async_save`: async_save_problem. The critic's keys are checked where it runs
    (_sections).

    Reads: actor_rollout_ref.actor.checkpoint, critic.checkpoint, critic.enable
    """
    for key, c in _sections(config):
        yield from _contents_problems(key, c.save_contents, "save_contents")
        if c.load_contents is not None:
            yield from _contents_problems(key, c.load_contents, "load_contents")
    for key, c in _sections(config):
        problem = async_save_problem(c.async_save, multiprocessing.get_all_start_methods(), key)
        if problem:
            yield problem
    if config.critic.enable and "hf_model" in config.critic.checkpoint.save_contents:
        yield (f"{CRITIC_KEY}.save_contents={config.critic.checkpoint.save_contents}: hf_model is not built for a "
               "critic (megarl writes HF copies of causal LMs; a critic's value head has no HF layout here); drop it")


def checkpoint_without_extra(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A warning: without `extra` (verl: the ranks' RNG states) megarl still saves the trainer's own
    state (controller.pt: step, data position, RNG), which resuming needs.

    Reads: actor_rollout_ref.actor.checkpoint.save_contents
    """
    c = config.actor_rollout_ref.actor.checkpoint
    if "extra" not in c.save_contents and "model" in c.save_contents:
        yield (f"{KEY}.save_contents={c.save_contents} without extra: megarl's checkpoints still hold the trainer's "
               "state (step, data position, RNG: controller.pt, kilobytes), which resuming needs")


def checkpoint_export_options(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Warnings, one per key given that changes nothing here: `strict=false` (verl passes it to
    Megatron-Bridge's save_hf_weights, megatron_checkpoint_manager.py `_save_model_as_hf_via_bridge`,
    whose SafeTensorsStateSource.save_generator then writes an HF copy missing tensors instead of
    failing): megarl writes its HF copy whole or not at all (megarl.bridge.convert.verify_hf checks it
    holds exactly the model's tensors, verl's strict=true). `save_lora_only=true`: verl's Megatron
    checkpoints do not read it (its FSDP manager alone does, fsdp_checkpoint_manager.py), nor does
    megarl, whose checkpoints hold the base weights with the adapters.

    Reads: actor_rollout_ref.actor.checkpoint, critic.checkpoint, critic.enable
    """
    for key, c in _sections(config):
        if not c.strict:
            yield (f"{key}.strict=false has no effect in megarl: its HF copy is written whole or not at all (checked "
                   "to hold exactly the model's tensors, verl's strict=true); verl would write a partial copy instead")
        if c.save_lora_only:
            yield (f"{key}.save_lora_only=true has no effect: verl's Megatron checkpoints do not read it (its FSDP "
                   "checkpoints do) and megarl's hold the base weights with the LoRA adapters (megarl export --lora "
                   "writes the adapter alone)")
