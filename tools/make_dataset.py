#!/usr/bin/env python
"""Write a synthetic verifiable task as verl-format parquet: train.parquet, val.parquet (RL),
sft_train.parquet, sft_val.parquet (prompt + reference response, for SFT warm-up) and
prefs_train.parquet, prefs_val.parquet (prompt + chosen answer + rejected near miss, for DPO).

    python tools/make_dataset.py --task add --out outputs/quickstart/data

Tasks: add ("23+45=" -> "68"), rev ("kqbd>" -> "dbqk"), sort ("31415:" -> "11345"); rows carry
data_source "megarl/<task>", scored by megarl.rewards.synthetic. The logic is
megarl.data.synthetic.write_task_dataset.
"""
import argparse

from megarl.data.synthetic import TASKS, write_task_dataset


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(TASKS), required=True)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train-size", type=int, default=10_000, help="RL training prompts")
    p.add_argument("--val-size", type=int, default=512, help="distinct validation prompts (RL, SFT and DPO)")
    p.add_argument("--sft-size", type=int, default=32_768, help="SFT training examples; 0: no SFT files")
    p.add_argument("--pref-size", type=int, default=4096, help="DPO training pairs; 0: no preference files")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        paths = write_task_dataset(a.task, a.out, train_size=a.train_size, val_size=a.val_size, sft_size=a.sft_size,
                                   pref_size=a.pref_size, seed=a.seed)
    except ValueError as exc:  # e.g. more validation prompts than the task has
        p.error(str(exc))
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
