"""reasoning-gym's procedural tasks, scored by the task's own `score_answer`.

Rows written by megarl.data.reasoning_gym carry data_source "reasoning_gym/<task>" and, in
extra_info["reasoning_gym"], how the library made them: the task's config (JSON), seed, size and the
row's index, and the entry itself (JSON: question, answer, metadata) for reading. `score_reasoning_gym`
builds the task's dataset from those, once per process, generates the entry again (`dataset[index]`,
so the library scores its own entry, not a JSON copy of it), checks its question is the row's (else
the installed reasoning-gym makes other data than the one that wrote the rows) and returns
`dataset.score_answer(answer, entry)`, the library's own score in [0, 1].

The answer given to it is what reasoning-gym's own evaluation reads: the text of the last
<answer>...</answer> in the response (`reasoning_gym.utils.extract_answer`); a response without
those tags is taken whole, cut at its first end-of-sequence marker and stripped (as megarl's
synthetic tasks are), so a model that was never taught the tags is scored on what it wrote.

The library is optional (`pip install 'megarl[envs]'`); `load_reasoning_gym` says what to install
when it is missing or at a version megarl does not support, and `task_class` names the close task
names when one is unknown.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import json
from types import ModuleType
from typing import Any

from packaging.specifiers import SpecifierSet

from megarl.config.errors import ConfigError
from megarl.config.optional_packages import supported_version
from megarl.rewards.synthetic import strip_response

PACKAGE = "reasoning-gym"
SUPPORTED = SpecifierSet(">=0.1.25,<0.2")  # tested: 0.1.25 (requirements/cpu-py3*.lock)
INSTALL = "pip install 'megarl[envs]' (or: pip install 'reasoning-gym>=0.1.25,<0.2')"
SOURCE_PREFIX = "reasoning_gym/"  # data_source of its rows: "reasoning_gym/<task>"
EXTRA_KEY = "reasoning_gym"  # extra_info key of {"config": JSON, "seed", "size", "index", "entry": JSON}


def load_reasoning_gym() -> ModuleType:
    """The `reasoning_gym` module; ConfigError with the fix if it is missing or unsupported."""
    supported_version(PACKAGE, SUPPORTED, "reasoning-gym tasks", INSTALL)
    return importlib.import_module("reasoning_gym")


def task_names() -> list[str]:
    """Every task name the installed reasoning-gym registers, sorted."""
    load_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(task: str) -> None:
    """ConfigError naming `task` and the close names if reasoning-gym has no such task."""
    names = task_names()
    if task not in names:
        close = difflib.get_close_matches(task, names, n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"its {len(names)} tasks start: {', '.join(names[:8])}, ..."
        raise ConfigError(f"reasoning-gym has no task {task!r}; {hint}")


@functools.lru_cache(maxsize=64)
def make_dataset(task: str, config_json: str, seed: int, size: int) -> Any:
    """reasoning_gym.create_dataset(task, seed=, size=, **config) (a ProceduralDataset), cached per
    process: building one can take a while, scoring calls it per sample."""
    check_task(task)
    reasoning_gym = load_reasoning_gym()
    return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))


def extract_answer(solution_str: str) -> str:
    """The answer reasoning-gym scores: the last <answer>...</answer>, else the whole response up to
    its first end marker, stripped. Call it after `make_dataset` has checked the library."""
    from reasoning_gym.utils import extract_answer as tagged

    answer = tagged(solution_str)
    return strip_response(solution_str) if answer is None else answer


def score_reasoning_gym(data_source: str, solution_str: str, extra_info: dict | None) -> float:
    """The task's own score_answer of the response's answer against the row's entry."""
    task = data_source[len(SOURCE_PREFIX):]
    if not extra_info or EXTRA_KEY not in extra_info:
        raise ValueError(f"a {data_source!r} row needs extra_info[{EXTRA_KEY!r}] (written by "
                         f"megarl.data.reasoning_gym); it has {sorted(extra_info or {})}")
    info = extra_info[EXTRA_KEY]
    dataset = make_dataset(task, info["config"], int(info["seed"]), int(info["size"]))
    entry = dataset[int(info["index"])]
    written = json.loads(info["entry"])["question"]
    if entry["question"] != written:
        raise ValueError(f"{PACKAGE} {importlib.metadata.version(PACKAGE)} generates another entry {info['index']} "
                         f"of {task!r} than the one in the data ({entry['question']!r} != {written!r}): write "
                         f"the data again with this version (tools/make_dataset.py)")
    return float(dataset.score_answer(extract_answer(solution_str), entry))
