"""Who may call the rollout servers: the rule on their API key."""
from __future__ import annotations

import os
from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig


def api_key_env_is_set(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A user's key for the rollout servers and router comes from an environment variable that is
    set, not empty and not starting with "-" (unset key: megarl makes a fresh one per run).

    Reads: actor_rollout_ref.rollout.api_key_env
    """
    name = config.actor_rollout_ref.rollout.api_key_env
    if name is not None and not os.environ.get(name):
        yield (f"actor_rollout_ref.rollout.api_key_env={name}: that environment variable is not set (or empty) "
               "here; export it, or leave the key unset for a fresh random key per run")
    elif name is not None and os.environ[name].startswith("-"):
        # SGLang's server and the router parse `--api-key KEY` with argparse, which takes "-..." for an option
        yield (f"actor_rollout_ref.rollout.api_key_env={name}: the key starts with '-', which SGLang's command "
               "line would read as an option; choose a key that does not")
