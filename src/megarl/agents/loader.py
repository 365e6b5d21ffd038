"""The user's episode function from a Python file (`actor_rollout_ref.rollout.agent.path` + `.name`).

    async def run_episode(client, sample) -> float | dict | None

`client` is an `openai.AsyncOpenAI` bound to megarl's endpoint and to this episode; `sample` is an
`EpisodeSample`. Problems visible before training (no file, import error, missing name, not an
async function of two arguments) raise ConfigError at start-up, naming the key.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Awaitable, Callable

from megarl.config.errors import ConfigError

EpisodeFn = Callable[[Any, Any], Awaitable[Any]]


def load_episode_fn(path: str, name: str = "run_episode") -> EpisodeFn:
    where = f"actor_rollout_ref.rollout.agent.path={path!r}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: no such file")
    module_name = "megarl_agent_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{where}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise ConfigError(f"{where}: importing it failed: {type(error).__name__}: {error}") from error
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"{where}: has no actor_rollout_ref.rollout.agent.name={name!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{where}: {name!r} must be an `async def {name}(client, sample)`")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as error:
        raise ConfigError(f"{where}: {name}{inspect.signature(fn)} cannot be called as {name}(client, sample): {error}") from error
    return fn
