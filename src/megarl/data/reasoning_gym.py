"""A reasoning-gym task written as verl parquet, scored by the task's own `score_answer`.

    write_reasoning_gym_dataset("chain_sum", "outputs/rg/data", train_size=1000, val_size=64, seed=0,
                                config={"min_terms": 2, "max_terms": 2})
    # -> train.parquet, val.parquet
    python tools/make_dataset.py --task reasoning_gym:chain_sum --config '{"min_terms": 2}' --out outputs/rg/data

The library makes every entry: train.parquet is `create_dataset(task, seed=seed, size=train_size,
**config)`, val.parquet the same with seed + 1 and val_size (the two may share a question where the
task has few distinct ones). Rows: data_source "reasoning_gym/<task>", prompt one user message (the
entry's question, after `system_prompt` as a system message when one is given), ability the task's
category, reward_model {"style": "rule", "ground_truth": the entry's answer}, extra_info {"split",
"index", "reasoning_gym": {"task", "config" (JSON), "seed", "size", "index", "entry" (JSON of
question, answer, metadata)}}: what megarl.rewards.reasoning_gym needs to score a response with the
library, and what anyone with the library needs to make the same rows again.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


from megarl.config.errors import ConfigError
from megarl.data.parquet import write_splits
from megarl.rewards.reasoning_gym import (
    EXTRA_KEY,
    SOURCE_PREFIX,
    check_task,
    make_dataset,
)

SPEC_PREFIX = "reasoning_gym:"  # tools/make_dataset.py --task reasoning_gym:<task>


def rows_of(task: str, config: dict[str, Any], seed: int, size: int, split: str,
            system_prompt: str | None) -> list[dict]:
    """verl rows of the `size` entries reasoning-gym makes for (task, config, seed)."""
    config_json = json.dumps(config, sort_keys=True)
    try:
        dataset = make_dataset(task, config_json, seed, size)
    except (TypeError, ValueError, AssertionError) as error:  # the task's config class refuses a key or value
        raise ConfigError(f"reasoning-gym task {task!r} refuses config {config_json}: {type(error).__name__}: "
                          f"{error}") from error
    rows = []
    for index in range(size):
        entry = dataset[index]
        prompt = [{"role": "user", "content": entry["question"]}]
        if system_prompt:
            prompt.insert(0, {"role": "system", "content": system_prompt})
        rows.append({
            "data_source": SOURCE_PREFIX + task,
            "prompt": prompt,
            "ability": dataset.category,
            "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
            "extra_info": {"split": split, "index": index, EXTRA_KEY: {
                "task": task, "config": config_json, "seed": seed, "size": size, "index": index,
                # metadata values JSON does not know (sets, objects) are written as their repr: for reading only
                "entry": json.dumps(entry, default=repr),
            }},
        })
    return rows


def write_reasoning_gym_dataset(task: str, out_dir: str | Path, *, train_size: int, val_size: int, seed: int = 0,
                                config: dict[str, Any] | None = None,
                                system_prompt: str | None = None) -> dict[str, Path]:
    """Write train.parquet and val.parquet of reasoning-gym's `task` to out_dir; {split: path}.
    ConfigError, before anything is written, if the library is missing or unsupported, the task unknown
    (with the close names) or its config refused."""
    check_task(task)
    splits = {"train": rows_of(task, config or {}, seed, train_size, "train", system_prompt),
              "val": rows_of(task, config or {}, seed + 1, val_size, "val", system_prompt)}
    return write_splits(out_dir, splits)


def write_source(data, default_dir: str | Path) -> dict[str, Path]:
    """The train and val files of `data.source` ("reasoning_gym:<task>", DataConfig's source keys), written once:
    {split: path} in data.source_dir, or `<default_dir>/data/<task>-<hash of the source keys>`, kept when both
    files are there already. ConfigError before anything is written, as write_reasoning_gym_dataset."""
    task = data.source[len(SPEC_PREFIX):]
    keys = {"task": task, "config": data.source_config, "train_size": data.source_train_size,
            "val_size": data.source_val_size, "seed": data.source_seed, "system_prompt": data.source_system_prompt}
    digest = hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(data.source_dir or Path(default_dir) / "data" / f"{task}-{digest}")
    paths = {split: out / f"{split}.parquet" for split in ("train", "val")}
    check_task(task)
    if all(p.is_file() for p in paths.values()):
        return paths
    return write_reasoning_gym_dataset(task, out, train_size=data.source_train_size, val_size=data.source_val_size,
                                       seed=data.source_seed, config=data.source_config,
                                       system_prompt=data.source_system_prompt)
