"""verifiers environments as agent episodes (docs/environments.md).

An agent file of two lines makes an installed verifiers environment the episodes of a run:

    from megarl.agents.verifiers_env import VerifiersConnector
    run_episode = VerifiersConnector("my-env", env_args={"turns": 2}).run_episode

`VerifiersConnector(env_id)` loads the environment once, in the driver, when the run loads the agent file
(verifiers' own `load_environment(env_id, **env_args)`: the module `env_id` with `-` as `_`).
`write_dataset(out)` writes its dataset (train) and eval dataset (val) as verl parquet: each row's prompt is
the environment's prompt (its system prompt included), and `extra_info.verifiers.input` holds the rest of
the row (answer, info, example_id, ...: the rollout's input, JSON). Each episode is the environment's own
`rollout` against megarl's endpoint (its chat calls through verifiers' OpenAI chat client, so megarl records
every call's tokens as any agent's), then its rubric's `score_rollout`: the rubric's reward is the episode's
score, its reward functions' values (`vf_<name>`) and the number of model turns (`env_turns`) go to the batch.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet

from megarl.config.errors import ConfigError
from megarl.config.optional_packages import supported_version
from megarl.data.parquet import write_splits

PACKAGE = "verifiers"
SUPPORTED = SpecifierSet(">=0.3.1,<0.4")  # tested: 0.3.1 (requirements/cpu-py3*.lock)
INSTALL = "pip install 'megarl[envs]'"
SOURCE_PREFIX = "verifiers/"  # data_source of the rows: verifiers/<env id>
EXTRA_KEY = "verifiers"  # extra_info key of what the rollout needs


class VerifiersEpisodeError(RuntimeError):
    """The environment failed during an episode: that episode fails, the rest of the batch is kept."""


def check_verifiers() -> str:
    """The installed verifiers's version; ConfigError with the fix when it is missing or unsupported."""
    return supported_version(PACKAGE, SUPPORTED, "megarl's verifiers connector", INSTALL)


def module_of(env_id: str) -> str:
    """The module verifiers imports for an environment id (verifiers.legacy.utils.env_utils.env_module_name)."""
    return env_id.replace("-", "_").split("/")[-1]


def load_environment(env_id: str, env_args: dict[str, Any], env_dir: str | None):
    """verifiers' own load_environment(env_id, **env_args), `env_dir` first on sys.path; ConfigError naming
    the id and the fix when its module is not found or its load_environment raises."""
    check_verifiers()
    if env_dir and env_dir not in sys.path:
        sys.path.insert(0, env_dir)
    module = module_of(env_id)
    if importlib.util.find_spec(module) is None:
        where = f" (nor in {env_dir})" if env_dir else ""
        raise ConfigError(f"verifiers environment {env_id!r}: no module {module!r} in this Python{where}; install "
                          f"the environment into {sys.executable} (pip install <its package>, or `prime env "
                          "install <owner>/<id>` from the Environments Hub) or fix the id")
    import verifiers

    try:
        return verifiers.load_environment(env_id, **env_args)
    except Exception as error:
        cause = error.__cause__ or error
        raise ConfigError(f"verifiers environment {env_id!r} did not load with env_args {env_args}: "
                          f"{type(cause).__name__}: {cause}\nFix: the module {module!r} must define "
                          "load_environment(**env_args) returning a verifiers Environment") from error


def chat_messages(prompt: Any, env_id: str) -> list[dict[str, str]]:
    """A verifiers prompt (a string or chat messages) as megarl's {role, content} messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = []
    for message in prompt:
        message = message if isinstance(message, dict) else message.model_dump()
        if not isinstance(message.get("content"), str):
            raise ConfigError(f"verifiers environment {env_id!r}: a prompt message's content is "
                              f"{type(message.get('content')).__name__}, not text; megarl's connector takes text "
                              "prompts only (no images or content parts)")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


class VerifiersConnector:
    def __init__(self, env_id: str, *, env_args: dict[str, Any] | None = None, env_dir: str | None = None):
        """Loads the environment. `env_id`: its id (`my-env` or `owner/my-env`); `env_args`: its
        load_environment's keyword arguments; `env_dir`: a folder to import it from (one not installed)."""
        self.env_id = env_id
        self.env = load_environment(env_id, dict(env_args or {}), env_dir)

    def rows(self, split: str, n: int = -1, seed: int | None = None) -> list[dict]:
        """verl rows of the environment's dataset (`train`) or eval dataset (`val`): its first `n` (all: -1),
        shuffled by `seed` when given (verifiers' get_dataset / get_eval_dataset)."""
        dataset = self.env.get_dataset(n, seed) if split == "train" else self.env.get_eval_dataset(n, seed)
        rows = []
        for index, row in enumerate(dataset):
            rows.append({
                "data_source": SOURCE_PREFIX + self.env_id,
                "prompt": chat_messages(row["prompt"], self.env_id),
                "reward_model": {"style": "rule", "ground_truth": str(row.get("answer") or "")},
                # the row less its prompt (answer, info, task, example_id, ...): the rollout's input with the prompt
                "extra_info": {"split": split, "index": index, EXTRA_KEY: {
                    "env_id": self.env_id, "input": json.dumps({k: v for k, v in row.items() if k != "prompt"})}},
            })
        return rows

    def write_dataset(self, out_dir: str | Path, *, train_size: int = -1, val_size: int = -1,
                      seed: int | None = None) -> dict[str, Path]:
        """train.parquet (the dataset) and val.parquet (the eval dataset) in out_dir; {split: path}."""
        return write_splits(out_dir, {"train": self.rows("train", train_size, seed),
                                      "val": self.rows("val", val_size, seed)})

    async def run_episode(self, client, sample) -> dict[str, Any]:
        """One episode: `client` is megarl's endpoint (an openai.AsyncOpenAI), `sample` an EpisodeSample whose
        row this connector wrote. The environment's rollout, then its rubric's score."""
        from verifiers.clients import (
            OpenAIChatCompletionsClient,  # the library is checked at start-up
        )

        extra = (sample.extra_info or {}).get(EXTRA_KEY)
        if extra is None:
            raise VerifiersEpisodeError(f"verifiers environment {self.env_id!r}: the row has no extra_info.{EXTRA_KEY}; "
                                        "write the data with VerifiersConnector.write_dataset")
        rollout_input = {**json.loads(extra["input"]), "prompt": sample.messages}
        try:
            state = await self.env.rollout(rollout_input, OpenAIChatCompletionsClient(client), sample.model, {})
            if state.get("error") is None:
                await self.env.rubric.score_rollout(state)
                await self.env.rubric.cleanup(state)
        except Exception as error:  # the environment's own code raised
            raise self._failed(error) from error
        if state.get("error") is not None:  # a verifiers Error inside the rollout (e.g. the endpoint refused a call)
            raise self._failed(state["error"])
        metrics = {f"vf_{name}": float(value) for name, value in (state.get("metrics") or {}).items()}
        return {"score": float(state["reward"]), "env_turns": len(state["trajectory"]), **metrics}

    def _failed(self, error: BaseException) -> VerifiersEpisodeError:
        return VerifiersEpisodeError(
            f"verifiers environment {self.env_id!r} failed mid-episode: {type(error).__name__}: "
            f"{error}. This episode fails, the rest of the batch is kept; fix the environment")
