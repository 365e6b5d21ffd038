"""Command-line plumbing shared by every entry point that takes an experiment config."""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

from megarl.config.errors import ConfigError

CONFIG_ERROR_EXIT = 2


def add_experiment_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", metavar="FILE.yaml", help="YAML experiment file (may list base files under 'defaults:')")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key.path=value",
        help="dotted overrides, e.g. algorithm.adv_estimator=grpo trainer.logger=['console','tensorboard']; "
        "+key=value adds a key inside a free-form dict",
    )


QUIET_LOGGERS = ("httpx", "httpcore", "openai")


def entry_point(fn):
    """Wrap a command's main(): plain log lines, a ConfigError printed as one readable message
    with exit status 2 (no stack trace), and a closed stdout pipe ending it quietly (status 1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="megarl: %(levelname)s: %(message)s")
            for chatty in QUIET_LOGGERS:  # one INFO line per HTTP request (rollout, agents, judge)
                logging.getLogger(chatty).setLevel(logging.WARNING)
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            print(f"megarl: {exc}", file=sys.stderr)
            raise SystemExit(CONFIG_ERROR_EXIT) from None
        except BrokenPipeError:  # `megarl plan | head`: the reader left; stop quietly
            # Python's documented recipe (library/signal.html, "Note on SIGPIPE"): point stdout at
            # devnull so that the interpreter's final flush does not raise again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise SystemExit(1) from None

    return wrapper
