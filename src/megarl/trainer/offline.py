"""What the offline trainers (SFT, DPO) share: the command line and the run around their loop.

    trainer = trainer_cls(config, tokenizer)   # places its engines with Ray
    trainer.fit(tracker); trainer.export(<default_local_dir>/<project>/<experiment>/hf)
"""
from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from megarl.config import ExperimentConfig, load_and_validate
from megarl.config.args import add_experiment_args, experiment_file
from megarl.trainer.preflight import DRY_RUN_HELP, DRY_RUN_OK, Kind, check_environment


def log_step(tracker, metrics: dict, step: int, total_steps: int, test_freq: int,
             validate: Callable[[], dict] | None) -> None:
    """Log training step `step`'s `metrics`, first adding `validate()`'s into them (in place) every
    `test_freq` steps and at the last step; never when `validate` is None or `test_freq` is 0."""
    if validate is not None and test_freq > 0 and (step % test_freq == 0 or step == total_steps):
        metrics.update(validate())
    tracker.log(metrics, step=step)


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
    root = Path(t.default_local_dir) / t.project_name / t.experiment_name
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
    the command line's; `verl_sft`: the overrides are verl's SFT trainer's (megarl.config.verl_sft)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_experiment_args(parser)
    parser.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    args = parser.parse_intermixed_args(argv)
    # SFT counts its steps from the data (megarl.trainer.sft.SFTTrainer)
    config = load_and_validate(experiment_file(args), [*defaults, *args.overrides], verl_sft, kind == "sft")
    print("config OK; checking data, model and this machine")
    config = check_environment(config, kind)  # seconds, before Ray starts
    if args.dry_run:
        print(DRY_RUN_OK)
        return 0
    from megarl.trainer.failures import run_and_report

    module, function = run.split(":")
    return run_and_report(getattr(importlib.import_module(module), function), config)
