"""OpenEnv environments as agent episodes (docs/environments.md).

An agent file of two lines makes an OpenEnv environment the episodes of a run:

    from megarl.agents.openenv_env import OpenEnvConnector
    run_episode = OpenEnvConnector("my_env.server.app:app").run_episode

`OpenEnvConnector(app)` starts the environment's server once, in the driver, when the run loads the
agent file: `python -m uvicorn <app> --host 127.0.0.1` on a free port, healthy on OpenEnv's `/health`,
stopped by its PID at exit (or `stop()`). Each episode opens its own OpenEnv session (the library's
`GenericEnvClient`, a WebSocket on the server's `/ws`: OpenEnv's HTTP `/reset` and `/step` keep no
state between calls), resets it with the row's `extra_info.openenv.reset` (e.g. `{"seed": 3}`), and
until the environment says `done` or `max_steps` actions were sent: the observation's
`observation_field` becomes a user message, the policy (megarl's endpoint) answers, and the answer is
the action's `action_field`. The episode's score is the sum of the step rewards (a step without one
counts 0); `env_steps` and `env_done` go to the batch and the metrics.
"""
from __future__ import annotations

import atexit
import importlib.util
import sys
from importlib.machinery import PathFinder
from typing import Any

from packaging.specifiers import SpecifierSet

from megarl.config.errors import ConfigError
from megarl.config.optional_packages import supported_version
from megarl.rollout.process import ServerProcess, ServerStartError, start_on_a_free_port

PACKAGE = "openenv"
SUPPORTED = SpecifierSet(">=0.10,<0.11")  # tested: 0.10.0 (requirements/cpu-py3*.lock)
INSTALL = "pip install 'megarl[envs]'"
HOST = "127.0.0.1"


class OpenEnvEpisodeError(RuntimeError):
    """The environment failed during an episode: that episode fails, the rest of the batch is kept."""


def check_openenv() -> str:
    """The installed openenv's version; ConfigError with the fix when it is missing or unsupported."""
    return supported_version(PACKAGE, SUPPORTED, "megarl's OpenEnv connector", INSTALL)


def check_app(app: str, app_dir: str | None) -> None:
    """ConfigError unless `app` is `module:attribute` with a module this Python finds (in `app_dir`
    first, as uvicorn's --app-dir)."""
    module, _, attribute = app.partition(":")
    if not module or not attribute:
        raise ConfigError(f"OpenEnv environment {app!r}: give the server's app as 'package.module:app' "
                          "(the module that calls openenv's create_app, and the name it binds)")
    top = module.split(".")[0]
    found = (PathFinder.find_spec(top, [app_dir]) if app_dir else None) or importlib.util.find_spec(top)
    if found is None:
        where = f" (nor in {app_dir})" if app_dir else ""
        raise ConfigError(f"OpenEnv environment {app!r}: no module {top!r} in this Python{where}; install the "
                          f"environment's package into {sys.executable} (pip install <its package>) or fix the name")


class OpenEnvConnector:
    def __init__(self, app: str, *, app_dir: str | None = None, action_field: str = "message",
                 observation_field: str = "prompt", max_steps: int = 4, connect_timeout_s: float = 10.0,
                 message_timeout_s: float = 60.0, startup_timeout_s: float = 60.0, log_path: str | None = None):
        """Starts the environment's server. `app`: its ASGI app, `package.module:app` (what openenv's
        `create_app` returned); `app_dir`: a folder to import it from; `message_timeout_s` bounds each
        reset and step (seconds)."""
        check_openenv()
        check_app(app, app_dir)
        self.app, self.action_field, self.observation_field = app, action_field, observation_field
        self.max_steps, self.connect_timeout_s, self.message_timeout_s = max_steps, connect_timeout_s, message_timeout_s
        module, _, attribute = app.partition(":")
        command = [sys.executable, "-m", "uvicorn", app, "--host", HOST, "--log-level", "warning"]
        if app_dir:
            command += ["--app-dir", app_dir]
        try:
            self.server = start_on_a_free_port(
                lambda port: ServerProcess(f"openenv-{module}", [*command, "--port", str(port)],
                                           f"http://{HOST}:{port}", log_path=log_path,
                                           startup_timeout_s=startup_timeout_s), HOST)
        except ServerStartError as error:
            raise ConfigError(f"OpenEnv environment {app!r} did not start: {error}\nFix: {module} must import in "
                              f"{sys.executable} and bind {attribute!r} to the app openenv's create_app returns") from None
        atexit.register(self.stop)

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        """Stop the environment's server (by its PID); idempotent."""
        self.server.stop()

    async def run_episode(self, client, sample) -> dict[str, Any]:
        """One episode: `client` is megarl's endpoint, `sample` an EpisodeSample."""
        from openenv.core.generic_client import (
            GenericEnvClient,  # the library is checked at start-up
        )

        reset = ((sample.extra_info or {}).get("openenv") or {}).get("reset") or {}
        messages = list(sample.messages)
        total, steps = 0.0, 0
        async with GenericEnvClient(base_url=self.url, connect_timeout_s=self.connect_timeout_s,
                                    message_timeout_s=self.message_timeout_s) as env:
            result = await self._call(env.reset(**reset), "reset")
            while not result.done and steps < self.max_steps:
                messages.append({"role": "user", "content": self._observation_text(result.observation)})
                reply = await client.chat.completions.create(model=sample.model, messages=messages)
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                result = await self._call(env.step({self.action_field: text}), f"step {steps + 1}")
                total += float(result.reward or 0.0)
                steps += 1
        return {"score": total, "env_steps": steps, "env_done": float(bool(result.done))}

    async def _call(self, call, what: str):
        try:
            return await call
        except Exception as error:
            raise OpenEnvEpisodeError(
                f"OpenEnv environment {self.app!r} failed at {what}: {type(error).__name__}: {error}. This episode "
                f"fails, the rest of the batch is kept; fix the environment (its server log: {self.server.log_path})"
            ) from error

    def _observation_text(self, observation: dict) -> str:
        if self.observation_field not in observation:
            raise OpenEnvEpisodeError(
                f"OpenEnv environment {self.app!r}: its observation has no {self.observation_field!r} "
                f"(fields: {sorted(observation)}); set OpenEnvConnector(observation_field=...) to the text the policy reads")
        return str(observation[self.observation_field])
