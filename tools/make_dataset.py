#!/usr/bin/env python
"""Write a synthetic verifiable task as verl-format parquet: train.parquet, val.parquet (RL),
sft_train.parquet, sft_val.parquet (prompt + reference response, for SFT warm-up) and
prefs_train.parquet, prefs_val.parquet (prompt + chosen answer + rejected near miss, for DPO).

    python tools/make_dataset.py --task add --out outputs/quickstart/data

Tasks: add ("23+45=" -> "68"), rev ("kqbd>" -> "dbqk"), sort ("31415:" -> "11345"); rows carry
data_source "megarl/<task>", scored by megarl.rewards.synthetic. The logic is
megarl.data.synthetic.write_task_dataset.

A reasoning-gym task (`pip install 'megarl[envs]'`; docs/environments.md) is written as train.parquet and
val.parquet, scored by the task's own score_answer (megarl.data.reasoning_gym):

    python tools/make_dataset.py --task reasoning_gym:chain_sum --config '{"min_terms": 2}' --out outputs/rg/data
"""
import argparse
import json

from megarl.config.errors import ConfigError
from megarl.data.reasoning_gym import SPEC_PREFIX, write_reasoning_gym_dataset
from megarl.data.synthetic import TASKS, write_task_dataset


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, help=f"{', '.join(TASKS)} or {SPEC_PREFIX}<task name>")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train-size", type=int, default=10_000, help="RL training prompts")
    p.add_argument("--val-size", type=int, default=512, help="distinct validation prompts (RL, SFT and DPO)")
    p.add_argument("--sft-size", type=int, default=32_768, help="SFT training examples; 0: no SFT files")
    p.add_argument("--pref-size", type=int, default=4096, help="DPO training pairs; 0: no preference files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default="{}", help="reasoning-gym tasks: the task's config as a JSON object")
    p.add_argument("--system-prompt", default=None, help="reasoning-gym tasks: a system message before each question")
    a = p.parse_args(argv)
    if a.task.startswith(SPEC_PREFIX):
        try:
            config = json.loads(a.config)
        except json.JSONDecodeError as exc:
            p.error(f"--config {a.config!r} is not JSON: {exc}")
        if not isinstance(config, dict):
            p.error(f"--config {a.config!r} is not a JSON object")
        try:
            paths = write_reasoning_gym_dataset(a.task[len(SPEC_PREFIX):], a.out, train_size=a.train_size,
                                                val_size=a.val_size, seed=a.seed, config=config,
                                                system_prompt=a.system_prompt)
        except ConfigError as exc:
            p.error(str(exc))
    elif a.task not in TASKS:
        p.error(f"--task: invalid choice: {a.task!r} (choose from {', '.join(TASKS)} or {SPEC_PREFIX}<task name>)")
    else:
        paths = synthetic(p, a)
    for name, path in paths.items():
        print(f"{name}: {path}")


def synthetic(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    """megarl's own task's files."""
    try:
        paths = write_task_dataset(a.task, a.out, train_size=a.train_size, val_size=a.val_size, sft_size=a.sft_size,
                                   pref_size=a.pref_size, seed=a.seed)
    except ValueError as exc:  # e.g. more validation prompts than the task has
        p.error(str(exc))
    return paths


if __name__ == "__main__":
    main()
