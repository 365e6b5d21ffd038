"""What the offline trainers (SFT, DPO) share: the command line, the run around their loop and
their mid-run checkpoints.

    trainer = trainer_cls(config, tokenizer)   # places its engines with Ray
    trainer.fit(tracker); trainer.export(<default_local_dir>/<project>/<experiment>/hf)

Checkpoints, as verl's SFT trainer (verl/trainer/sft_trainer.py `fit`, utils/checkpoint/checkpoint_handler.py):
every `trainer.save_freq` steps and at the last step (save_freq > 0) a megarl checkpoint
(megarl.checkpoint: the actor per actor_rollout_ref.actor.checkpoint.save_contents, the step, the data
sampler's position and the RNG state) goes to `<default_local_dir>/<project>/<experiment>/global_step_N`;
`trainer.resume_mode` auto (the newest there), resume_path (`trainer.resume_from_path`) or disable picks
the one a run continues from, at the step after it. SIGTERM or SIGUSR1 finishes the step, checkpoints it
and stops with exit status 75, Ctrl-C stops at once (megarl.trainer.preemption), as the RL trainer.
"""
from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from megarl import checkpoint
from megarl.config import ConfigError, ExperimentConfig, load_and_validate
from megarl.config.args import add_experiment_args, experiment_file
from megarl.config.torchrun import TORCHRUN_ENV, layout_from_env, multi_node_problem
from megarl.runtime.roles import profile_step
from megarl.trainer.preemption import Preempted, StopRequest
from megarl.trainer.preflight import DRY_RUN_HELP, DRY_RUN_OK, Kind, check_environment


def fit_offline(trainer, tracker, train_step: Callable[[], dict], validate: Callable[[], dict] | None,
                validate_first: bool = False) -> dict:
    """The offline trainers' loop: from the step after the checkpoint `trainer.resume_mode` picks
    to `trainer.total_steps`, `train_step()` (the step's metrics), logged with `validate()`'s every
    `trainer.test_freq` steps (and at step 0 with `validate_first`, when the run starts fresh), a
    checkpoint where `save_due`. A background write (async_save) is committed at a later step
    boundary, and at the end at the latest. On SIGTERM/SIGUSR1 the step finishes, is checkpointed, and
    `Preempted` is raised; Ctrl-C or a second signal abandons the step (megarl.trainer.preemption).
    `trainer`: config, actor, sampler, checkpoints, total_steps. Returns the last step's metrics."""
    config, t = trainer.config, trainer.config.trainer
    resumed = resume_offline(config, trainer.actor, trainer.sampler)
    if validate is not None and validate_first and resumed == 0:
        tracker.log(validate(), step=0)
    metrics = {}
    with StopRequest() as stop:
        for step in range(resumed + 1, trainer.total_steps + 1):
            stop.step = step - 1
            with profile_step(config, {"actor": trainer.actor}, step):  # verl's global_profiler
                metrics = train_step()
            log_step(tracker, metrics, step, trainer.total_steps, t.test_freq, validate)
            trainer.checkpoints.poll()
            saved = save_due(config, step, trainer.total_steps)
            if saved or stop.signum is not None:
                save_offline_checkpoint(config, step, trainer.checkpoints, trainer.sampler)
            if stop.signum is not None:
                raise Preempted(stop.signum, step, str(trainer.checkpoints.finish()))
        trainer.checkpoints.finish()
    return metrics


def log_step(tracker, metrics: dict, step: int, total_steps: int, test_freq: int,
             validate: Callable[[], dict] | None) -> None:
    """Log training step `step`'s `metrics`, first adding `validate()`'s into them (in place) every
    `test_freq` steps and at the last step; never when `validate` is None or `test_freq` is 0."""
    if validate is not None and test_freq > 0 and (step % test_freq == 0 or step == total_steps):
        metrics.update(validate())
    tracker.log(metrics, step=step)


def experiment_dir(config: ExperimentConfig) -> Path:
    """`<default_local_dir>/<project>/<experiment>`: the run's checkpoints, logs and HF export."""
    t = config.trainer
    return Path(t.default_local_dir) / t.project_name / t.experiment_name


def save_due(config: ExperimentConfig, step: int, total_steps: int) -> bool:
    """Whether step `step` (1-based) of `total_steps` ends with a checkpoint: every `trainer.save_freq`
    steps and at the last, none with save_freq <= 0 (verl's sft_trainer.py `fit`)."""
    freq = config.trainer.save_freq
    return freq > 0 and (step % freq == 0 or step == total_steps)


def save_offline_checkpoint(config: ExperimentConfig, step: int, checkpoints: checkpoint.Checkpoints,
                            sampler) -> Path | None:
    """The checkpoint of `step` (atomic: megarl.checkpoint.Checkpoints, the actor's): the actor per its
    save_contents, the step, the data sampler's position and the torch RNG state; its directory, or None
    while written in the background (async_save: `checkpoints.poll` / `finish` commit it)."""
    import torch

    state = {"step": step, "sampler": sampler.state_dict(), "torch_rng": torch.get_rng_state()}
    return checkpoints.save(experiment_dir(config), step, state)


def resume_offline(config: ExperimentConfig, actor, sampler) -> int:
    """Load the checkpoint `resume_dir` picks into the actor, the sampler and the torch RNG; returns
    its step (0: none, a fresh start)."""
    import torch

    directory = resume_dir(config)
    if directory is None:
        return 0
    actor.load_checkpoint(str(directory / "actor"), checkpoint.loads_optimizer(config, directory))
    state = checkpoint.load_controller_state(directory)
    sampler.load_state_dict(state["sampler"])
    torch.set_rng_state(state["torch_rng"])
    print(f"resumed from {directory} (step {state['step']})")
    return state["step"]


def resume_dir(config: ExperimentConfig) -> Path | None:
    """The checkpoint an offline run continues from, as verl's SFT trainer picks it
    (verl/utils/checkpoint/checkpoint_handler.py `_determine_resume_path`): `trainer.resume_mode=auto`
    takes `trainer.resume_from_path` where one is given, else the newest complete checkpoint of the
    experiment; resume_path and disable as megarl.checkpoint.find_resume_dir."""
    t = config.trainer
    if t.resume_mode == "auto" and t.resume_from_path:
        config = replace(config, trainer=replace(t, resume_mode="resume_path"))
    return checkpoint.find_resume_dir(config)


def run_offline(config: ExperimentConfig, trainer_cls, done: str) -> Path:
    """Train with `trainer_cls`, export the HF checkpoint; returns its directory. `done` finishes
    the sentence "exported the ... model to DIR"."""
    import torch
    from transformers import AutoTokenizer

    from megarl.tracking import Tracker
    from megarl.runtime.cluster import connect_ray

    t = config.trainer
    tokenizer = AutoTokenizer.from_pretrained(config.data.tokenizer or config.actor_rollout_ref.model.path)
    connect_ray(config)
    root = experiment_dir(config)
    trainer = trainer_cls(config, tokenizer)
    tracker = Tracker(t.logger, t.project_name, t.experiment_name, root / "logs", total_steps=trainer.total_steps)
    try:
        torch.manual_seed(t.seed)
        trainer.fit(tracker)
        out = trainer.export(root / "hf")
        print(f"exported the {done} model to {out}")
        return out
    finally:
        trainer.shutdown()
        plot = tracker.finish()
        if tracker.history:
            print(tracker.summary())
        if plot:
            print(f"plot: {plot}")


def offline_main(prog: str, description: str, run: str, argv: list[str] | None, kind: Kind,
                 defaults: tuple[str, ...] = (), verl_sft: bool = False) -> int:
    """`prog [--config X.yaml] [--dry-run] key.path=value ...`: validate, check the machine, then
    call `run` ("module:function", imported only then) with the config. `defaults`: overrides before
    the command line's; `verl_sft`: the overrides are verl's SFT trainer's (megarl.config.verl_sft).
    Under torchrun (verl's SFT scripts) rank 0 is the driver, on torchrun's GPUs (megarl.config.torchrun),
    and the other ranks stop at once with status 0."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_experiment_args(parser)
    parser.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parser.parse_intermixed_args(argv)
    overrides = [*defaults, *args.overrides]
    torchrun = layout_from_env(os.environ)
    if torchrun is not None:
        if torchrun.rank != 0:
            print(f"torchrun rank {torchrun.rank}: megarl's driver runs on rank 0 and places every worker; "
                  "this rank has nothing to do")
            return 0
        if problem := multi_node_problem(torchrun, prog):
            raise ConfigError(problem)
        for name in TORCHRUN_ENV:  # torchrun's rank variables would mislead the workers Ray starts from here
            os.environ.pop(name, None)
        overrides += torchrun.overrides()  # torchrun's layout wins, as in verl's SFT trainer
        print(f"under torchrun: {' '.join(torchrun.overrides())}")
    # SFT counts its steps from the data (megarl.trainer.sft.SFTTrainer)
    config = load_and_validate(experiment_file(args), overrides, verl_sft, kind == "sft")
    print("config OK; checking data, model and this machine")
    config = check_environment(config, kind)  # seconds, before Ray starts
    if args.dry_run:
        print(DRY_RUN_OK)
        return 0
    from megarl.trainer.failures import run_and_report

    module, function = run.split(":")
    return run_and_report(getattr(importlib.import_module(module), function), config)
