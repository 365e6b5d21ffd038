"""Command-line plumbing shared by every entry point that takes an experiment config."""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path

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
    # Hydra's options, as every verl script writes them (--config-path=config --config-name='ppo_megatron_trainer.yaml')
    parser.add_argument("--config-path", "-cp", metavar="DIR", help="verl/Hydra style: the directory of --config-name")
    parser.add_argument("--config-name", "-cn", metavar="NAME", help="verl/Hydra style: a YAML file in --config-path "
                        "(verl's own ppo_trainer / ppo_megatron_trainer mean megarl's defaults)")


# verl's packaged base configs: megarl's schema defaults play their part.
VERL_BASE_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer",
                     # verl/experimental/*/config: the entry point's own defaults (megarl.config.verl_compat.VERL_MODULES)
                     "fully_async_ppo_megatron_trainer", "one_step_off_ppo_megatron_trainer", "sft_trainer_engine")
# verl-recipe's configs built on verl's base config with defaults of their own: name -> megarl's equivalent
VERL_RECIPE_CONFIGS = {name: Path(__file__).resolve().parent / "verl_configs" / f"{name}.yaml"
                       for name in ("dapo_megatron_trainer", "dapo_qat_megatron_trainer")}


def experiment_file(args: argparse.Namespace) -> str | None:
    """The YAML experiment file the arguments name: --config, or Hydra's --config-path/--config-name
    (the name with or without .yaml, in the path relative to the working directory). A verl base
    config name that is not a file here means megarl's defaults, and a verl-recipe config name
    (VERL_RECIPE_CONFIGS) megarl's file of the same defaults, each with one warning line."""
    config_name, config_path = getattr(args, "config_name", None), getattr(args, "config_path", None)
    if args.config or not config_name:
        if config_path and not config_name:
            raise ConfigError(f"--config-path={config_path} needs --config-name (or use --config FILE.yaml)")
        return args.config
    name = config_name if config_name.endswith((".yaml", ".yml")) else f"{config_name}.yaml"
    candidate = Path(config_path or ".") / name
    if candidate.is_file():
        return str(candidate)
    if Path(name).stem in VERL_RECIPE_CONFIGS:
        packaged = VERL_RECIPE_CONFIGS[Path(name).stem]
        logging.getLogger("megarl.config").warning(
            "--config-name=%s: verl-recipe's config; megarl loads its equivalent %s (%s is not a file)",
            config_name, packaged, candidate)
        return str(packaged)
    if Path(name).stem in VERL_BASE_CONFIGS:
        logging.getLogger("megarl.config").warning(
            "--config-name=%s: verl's packaged base config; megarl's schema defaults stand in for it (%s is not a file)",
            config_name, candidate)
        return None
    raise ConfigError(f"--config-path/--config-name: config file not found: {candidate}")


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
