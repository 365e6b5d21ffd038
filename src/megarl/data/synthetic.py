"""Synthetic verifiable tasks in verl's parquet format, small enough for a tiny model on a CPU.

    add   "23+45="  -> "68"      two numbers in 0..99                 (the quickstart's task)
    rev   "kqbd>"   -> "dbqk"    4 to 6 letters, reversed
    sort  "31415:"  -> "11345"   5 digits, sorted

    write_task_dataset("add", "outputs/quickstart/data", pref_size=4096)
    # -> train.parquet, val.parquet (RL), sft_train.parquet, sft_val.parquet (SFT warm-up),
    #    prefs_train.parquet, prefs_val.parquet (DPO pairs)

Rows: data_source "megarl/<task>" (scored by megarl.rewards.synthetic), prompt one user message,
reward_model {"style": "rule", "ground_truth": answer}, extra_info {"split", "index"}; SFT files
add a `response` column holding the answer; preference files add `chosen` (the answer) and
`rejected` (a near miss: a wrong answer close to it, see `near_miss`). Validation prompts are
distinct, and no training prompt is a validation prompt. Everything follows from the seed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megarl.data.parquet import write_splits

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


def make_rev(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(4, 6)))
    return f"{s}>", s[::-1]


def make_sort(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice("0123456789") for _ in range(5))
    return f"{s}:", "".join(sorted(s))


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to `answer`: a number off by 1 to 3 (never negative), else the same
    string with one character replaced by another of its kind (letter or digit)."""
    if answer.isdigit():
        value = int(answer)
        offsets = [d for d in (-3, -2, -1, 1, 2, 3) if value + d >= 0]
        return str(value + rng.choice(offsets))
    position = rng.randrange(len(answer))
    alphabet = "0123456789" if answer[position].isdigit() else LETTERS
    replacement = rng.choice([c for c in alphabet if c != answer[position]])
    return answer[:position] + replacement + answer[position + 1 :]


@dataclass(frozen=True)
class Task:
    name: str
    ability: str
    make: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt text, answer)

    @property
    def data_source(self) -> str:
        return f"megarl/{self.name}"


TASKS = {
    "add": Task("add", "arithmetic", make_add),
    "rev": Task("rev", "string", make_rev),
    "sort": Task("sort", "sorting", make_sort),
}


def distinct_examples(task: Task, n: int, rng: random.Random) -> list[tuple[str, str]]:
    """n examples with pairwise different prompts."""
    seen: dict[str, str] = {}
    for _ in range(20 * n):  # ample unless n nears the number of distinct prompts
        if len(seen) == n:
            break
        prompt, answer = task.make(rng)
        seen.setdefault(prompt, answer)
    if len(seen) < n:
        raise ValueError(f"task {task.name!r} has too few distinct prompts for {n} validation examples")
    return list(seen.items())


def examples_avoiding(task: Task, n: int, rng: random.Random, avoid: set[str]) -> list[tuple[str, str]]:
    """n independent draws (repeats allowed) whose prompts are not in `avoid`."""
    out: list[tuple[str, str]] = []
    while len(out) < n:
        prompt, answer = task.make(rng)
        if prompt not in avoid:
            out.append((prompt, answer))
    return out


def to_rows(task: Task, examples: list[tuple[str, str]], split: str, with_response: bool) -> list[dict]:
    """verl-format rows (plus `response` for SFT)."""
    rows = []
    for index, (prompt, answer) in enumerate(examples):
        row = {
            "data_source": task.data_source,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": task.ability,
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index},
        }
        if with_response:
            row["response"] = answer
        rows.append(row)
    return rows


def preference_rows(task: Task, examples: list[tuple[str, str]], split: str, rng: random.Random) -> list[dict]:
    """verl-format rows plus `chosen` (the answer) and `rejected` (its `near_miss`), for DPO."""
    rows = to_rows(task, examples, split, with_response=False)
    for row, (_, answer) in zip(rows, examples):
        row["chosen"], row["rejected"] = answer, near_miss(answer, rng)
    return rows


def write_task_dataset(
    task_name: str,
    out_dir: str | Path,
    *,
    train_size: int = 10_000,
    val_size: int = 512,
    sft_size: int = 32_768,
    pref_size: int = 0,
    seed: int = 0,
) -> dict[str, Path]:
    """Write train.parquet and val.parquet (RL) and, when sft_size > 0, sft_train.parquet and
    sft_val.parquet, when pref_size > 0, prefs_train.parquet (pref_size pairs) and
    prefs_val.parquet (all with the same validation prompts) to out_dir; return {split name: path}.

    Defaults fit the quickstart: 300 steps x 32 prompts, SFT ~240 steps x 128 examples.
    """
    if task_name not in TASKS:
        raise ValueError(f"unknown task {task_name!r}; choose from {', '.join(TASKS)}")
    task = TASKS[task_name]
    def rng(stream: str) -> random.Random:  # one independent, seeded stream per split
        return random.Random(f"megarl/{task_name}/{stream}/{seed}")

    val = distinct_examples(task, val_size, rng("val"))
    val_prompts = {p for p, _ in val}
    train = examples_avoiding(task, train_size, rng("train"), val_prompts)
    splits = {"train": to_rows(task, train, "train", False), "val": to_rows(task, val, "val", False)}
    if sft_size > 0:
        sft = examples_avoiding(task, sft_size, rng("sft"), val_prompts)
        splits["sft_train"] = to_rows(task, sft, "train", True)
        splits["sft_val"] = to_rows(task, val, "val", True)
    if pref_size > 0:
        prefs = examples_avoiding(task, pref_size, rng("prefs"), val_prompts)
        splits["prefs_train"] = preference_rows(task, prefs, "train", rng("prefs_rejected"))
        splits["prefs_val"] = preference_rows(task, val, "val", rng("prefs_val_rejected"))
    return write_splits(out_dir, splits)
