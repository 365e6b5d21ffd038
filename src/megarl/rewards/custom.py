"""A user's reward function from a Python file (`custom_reward_function.path` and `.name`).

The function is called as `fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
**reward_kwargs)` and returns a float or a dict with a "score" key (other keys are reported per
sample). Every problem that can be seen before training (missing file, import error, missing
function, wrong signature) raises ConfigError at start-up. Load the function in the process
that calls it (pass the path and name between processes, not the function).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
import sys
from types import ModuleType
from typing import Any, Callable, Optional

from megarl.config.errors import ConfigError
from megarl.rewards.dispatch import default_compute_score

ScoreFn = Callable[..., Any]
ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


def import_user_file(path: str, where: str, prefix: str) -> ModuleType:
    """Import the user's Python file `path` as module `<prefix>_<hash of its path>`; ConfigError
    naming `where` (the config key and value) if it is missing or fails to import."""
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file")
    module_name = f"{prefix}_{hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses and pickle in the file resolve their module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ConfigError(f"{where}: importing it failed: {type(error).__name__}: {error}") from error
    return module


def load_custom_reward_fn(path: str, name: str = "compute_score",
                          reward_kwargs: Optional[dict[str, Any]] = None) -> ScoreFn:
    """Import `path` and return its function `name`, with `reward_kwargs` bound."""
    reward_kwargs = dict(reward_kwargs or {})
    where = f"custom_reward_function.path={path!r}"
    module = import_user_file(path, where, "megarl_custom_reward")
    module_name = module.__name__
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name)
        raise ConfigError(f"{where}: has no function custom_reward_function.name={name!r}; it defines {defined}")
    if not callable(fn):
        raise ConfigError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind(**{arg: None for arg in ARGUMENTS}, **reward_kwargs)
    except TypeError as error:
        raise ConfigError(
            f"{where}: {name}{inspect.signature(fn)} cannot be called as {name}({', '.join(ARGUMENTS)}"
            f"{''.join(f', {k}' for k in reward_kwargs)}) with keywords: {error}"
        ) from error
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


def select_score_fn(path: Optional[str], name: str = "compute_score",
                    reward_kwargs: Optional[dict[str, Any]] = None) -> ScoreFn:
    """The user's function when `path` is set, else the default dispatch by data_source."""
    return load_custom_reward_fn(path, name, reward_kwargs) if path else default_compute_score
