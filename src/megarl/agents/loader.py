"""The user's episode function from a Python file (`actor_rollout_ref.rollout.agent.path` + `.name`).

    async def run_episode(client, sample) -> float | dict | None

`client` is an `openai.AsyncOpenAI` bound to megarl's endpoint and to this episode; `sample` is an
`EpisodeSample`. Problems visible before training (no file, import error, missing name, not an
async function of two arguments) raise ConfigError at start-up, naming the key.
"""
from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

from megarl.config.errors import ConfigError
from megarl.rewards.custom import import_user_file

EpisodeFn = Callable[[Any, Any], Awaitable[Any]]


def load_episode_fn(path: str, name: str = "run_episode") -> EpisodeFn:
    where = f"actor_rollout_ref.rollout.agent.path={path!r}"
    module = import_user_file(path, where, "megarl_agent")
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
