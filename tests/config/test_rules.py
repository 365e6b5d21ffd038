"""The rule registry: one loop collects every rule's messages; each rule names the keys it reads."""
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import typing
from pathlib import Path

import pytest

import megarl.config.rules as rules_package
from megarl.config import ConfigError, ExperimentConfig, load_and_validate, load_config
from megarl.config.rules import RULES, UNRESOLVED_WARNING_RULES, WARNING_RULES, DerivedSizes
from megarl.config.validate import resolve

REPO = Path(__file__).resolve().parents[2]
REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]


def reads(rule) -> list[str]:
    """The keys a rule's docstring names after `Reads:`."""
    _, found, keys = (inspect.getdoc(rule) or "").partition("Reads:")
    assert found, f"{rule.__name__}: its docstring has no 'Reads:' line"
    return [key.strip() for key in keys.split(",") if key.strip()]


def in_schema(path: str) -> bool:
    """Whether the dotted path is a key or a group of ExperimentConfig's dataclasses."""
    cls = ExperimentConfig
    for name in path.split("."):
        if not dataclasses.is_dataclass(cls) or name not in {f.name for f in dataclasses.fields(cls)}:
            return False
        cls = typing.get_type_hints(cls)[name]
    return True


def test_the_loop_collects_the_messages_of_independent_rules_in_one_error_in_registry_order():
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + ["trainer.logger=[console,tensorbord]", "algorithm.gamma=1.5"])
    assert str(info.value) == (
        "invalid config:\n"
        "  - algorithm.gamma=1.5: must be in [0.0, 1.0]\n"
        "  - trainer.logger: unknown logger 'tensorbord'; choose from ['console', 'tensorboard', 'wandb']"
    )


def test_every_rule_written_is_registered_once():
    written = set()
    for module_info in pkgutil.iter_modules(rules_package.__path__):
        module = importlib.import_module(f"{rules_package.__name__}.{module_info.name}")
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__ and list(inspect.signature(function).parameters) == ["config", "sizes"]:
                written.add(function)
    assert len(RULES) == len(set(RULES)) and not set(RULES) & set(WARNING_RULES)
    assert written == set(RULES) | set(WARNING_RULES) | set(UNRESOLVED_WARNING_RULES)


@pytest.mark.parametrize("rule", RULES + WARNING_RULES + UNRESOLVED_WARNING_RULES, ids=lambda rule: rule.__name__)
def test_every_rule_names_keys_that_exist_in_the_schema(rule):
    assert inspect.getdoc(rule).partition("\n")[0].strip(), f"{rule.__name__}: no summary line"
    keys = reads(rule)
    assert keys
    assert [key for key in keys if not in_schema(key)] == []


class Recorder:
    """Stands for a config group and records the dotted path of every key read through it."""

    def __init__(self, group, path: str, seen: set):
        self._group, self._path, self._seen = group, path, seen

    def __getattr__(self, name):
        value = getattr(self._group, name)
        path = f"{self._path}.{name}" if self._path else name
        if dataclasses.is_dataclass(value):
            return Recorder(value, path, self._seen)
        self._seen.add(path)
        return value


@functools.cache
def configs_to_read() -> list[ExperimentConfig]:
    """The defaults, every shipped experiment, and one that turns the optional parts on."""
    shipped = [path for path in sorted((REPO / "configs").rglob("*.yaml")) if path.name != "base.yaml"]
    everything_on = load_config(None, REQUIRED + [
        "critic.enable=true", "reward_model.enable=true", "reward_model.max_length=4096",
        "reward_model.add_rule_reward=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
        "actor_rollout_ref.rollout.agent.judge.url=http://judge/v1",
        "actor_rollout_ref.rollout.agent.judge.api_key_env=JUDGE_KEY",
        "placement.mode=split", "placement.rollout_gpus=4", "data.gen_batch_size=2048",
        "algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=4",
    ])
    return [resolve(c) for c in [load_config(None, REQUIRED), *map(load_config, shipped), everything_on]]


@pytest.mark.parametrize("rule", RULES + WARNING_RULES + UNRESOLVED_WARNING_RULES, ids=lambda rule: rule.__name__)
def test_every_rule_reads_only_the_keys_it_names(rule):
    declared = reads(rule)
    for config in configs_to_read():
        seen: set[str] = set()
        list(rule(Recorder(config, "", seen), DerivedSizes.from_config(config)))
        unnamed = [key for key in seen if not any(key == d or key.startswith(d + ".") for d in declared)]
        assert unnamed == [], f"{rule.__name__} reads keys its docstring does not name"
