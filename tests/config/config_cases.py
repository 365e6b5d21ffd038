"""What most config tests need: the two keys every experiment must set, and load-and-validate
with overrides on top, expecting success (`ok`) or a ConfigError whose message is returned (`fails`)."""
import pytest

from megarl.config import ConfigError, load_and_validate

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]


def ok(*overrides):
    return load_and_validate(None, REQUIRED + list(overrides))


def fails(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        ok(*overrides)
    return str(info.value)
