"""The experiment config: typed schema, YAML + dotted overrides, validation.

    config = load_and_validate("configs/quickstart.yaml", ["trainer.nnodes=2"])

Imports neither torch, ray nor megatron, so it is cheap to use anywhere (CLI, sbatch checks).
"""
from __future__ import annotations

import dataclasses

import yaml

from megarl.config.errors import ConfigError
from megarl.config.load import load_config
from megarl.config.schema import ExperimentConfig
from megarl.config.validate import BatchPlan, batch_plan, validate

__all__ = [
    "BatchPlan",
    "ConfigError",
    "ExperimentConfig",
    "batch_plan",
    "load_and_validate",
    "load_config",
    "to_yaml",
    "validate",
]


def load_and_validate(config_file=None, overrides=(), verl_sft: bool = False,
                      steps_from_data: bool = False) -> ExperimentConfig:
    """load_config + validate: the resolved config, or ConfigError naming every problem."""
    return validate(load_config(config_file, list(overrides), verl_sft), steps_from_data)


def to_yaml(config: ExperimentConfig) -> str:
    """The config as nested YAML in schema order (re-loadable with --config)."""
    return yaml.safe_dump(dataclasses.asdict(config), sort_keys=False, default_flow_style=False)
