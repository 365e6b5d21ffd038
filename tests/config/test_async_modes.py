"""The async_training keys at load time (rule `async_modes_fit_the_loop`)."""
import logging

import pytest

from megarl.config import ConfigError, load_and_validate

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
SPLIT = ["placement.mode=split", "placement.rollout_gpus=4"]
TIS = ["actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"]


def errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + list(overrides))
    return str(info.value)


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_overlap_needs_split_placement_and_the_error_names_the_keys(mode):
    message = errors(f"async_training.mode={mode}")
    assert f"async_training.mode={mode}" in message and "placement.mode=split" in message
    assert load_and_validate(None, REQUIRED + SPLIT + TIS + [f"async_training.mode={mode}"]).async_training.mode == mode


def test_sync_stays_the_default_and_needs_nothing():
    assert load_and_validate(None, REQUIRED).async_training.mode == "sync"


def test_fully_async_needs_a_staleness_bound_of_one_version_or_more():
    assert "async_training.max_staleness=0" in errors(*SPLIT, "async_training.mode=fully_async",
                                                      "async_training.max_staleness=0")


@pytest.mark.parametrize("override,key", [
    ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable"),
    ("algorithm.adv_estimator=remax", "algorithm.adv_estimator=remax"),
])
def test_loops_of_more_than_one_batch_per_step_are_refused(override, key):
    assert key in errors(*SPLIT, "async_training.mode=one_step_off", override)


def test_an_unknown_mode_or_policy_is_refused():
    assert "async_training.mode" in errors(*SPLIT, "async_training.mode=async")
    assert "async_training.stale_samples" in errors(*SPLIT, "async_training.stale_samples=keep")


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_partial_rollouts_belong_to_fully_async(mode):
    message = errors(*SPLIT, f"async_training.mode={mode}", "async_training.partial_rollout=true")
    assert "async_training.partial_rollout=true" in message and "async_training.mode=fully_async" in message
    config = load_and_validate(None, REQUIRED + SPLIT + TIS + ["async_training.mode=fully_async",
                                                         "async_training.partial_rollout=true"])
    assert config.async_training.partial_rollout


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_modes_without_an_off_policy_correction_warn_and_run_as_verl_does(mode, caplog):
    """Trained at version v on samples of version v - 1 or older: without a correction the gradient
    is the behaviour policy's. verl runs such a config with a warning (issue 52: megarl refused it);
    megarl now warns once, naming the keys that correct it, and sync mode says nothing."""
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(None, REQUIRED + SPLIT + [f"async_training.mode={mode}"])
    assert config.async_training.mode == mode
    lines = [r.getMessage() for r in caplog.records if "off-policy" in r.getMessage()]
    assert len(lines) == 1 and f"async_training.mode={mode}" in lines[0], lines
    assert "actor_rollout_ref.actor.tis_imp_ratio_cap" in lines[0]
    assert "actor_rollout_ref.actor.use_rollout_log_probs=true" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        load_and_validate(None, REQUIRED + SPLIT + TIS + [f"async_training.mode={mode}"])
        load_and_validate(None, REQUIRED + SPLIT + ["actor_rollout_ref.actor.use_rollout_log_probs=true",
                                                    f"async_training.mode={mode}"])
        load_and_validate(None, REQUIRED + SPLIT)
    assert not [r for r in caplog.records if "off-policy" in r.getMessage()]


def test_rollout_log_probs_with_truncated_importance_sampling_is_refused_naming_both_keys():
    """exp(rollout - rollout) = 1 on every token: the cap would do nothing."""
    message = errors("actor_rollout_ref.actor.use_rollout_log_probs=true", *TIS)
    assert "actor_rollout_ref.actor.use_rollout_log_probs=true" in message
    assert "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0" in message
