"""algorithm.rollout_correction at load time: its refusals, one by one, and its keyword arguments."""
import logging

import pytest

from megarl.algos.from_config import bypass_kwargs, rollout_correction_kwargs
from megarl.config.rules.rollout_correction import parse_band, parse_rejection

from config_cases import fails, ok

RC = "algorithm.rollout_correction"


@pytest.mark.parametrize("overrides, expected", [
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0"],
     f"{RC}.rollout_is_threshold='0': bounds must be > 0"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=-2"], "rollout_is_threshold='-2': bounds must be > 0"),
    ([f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=0.0_2.0"],
     "rollout_is_threshold='0.0_2.0': bounds must be > 0"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5"],
     "rollout_is_threshold='0.5': a cap must be >= 1"),
    # YAML reads 0.5_2 as 0.52 (as Hydra does): refused as a cap, the message says how to write the band
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_2"],
     "rollout_is_threshold='0.52': a cap must be >= 1 (a band is written with a decimal point in both bounds"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.0_5.0"],
     "rollout_is_threshold='2.0_5.0': the band must hold 1"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=high"], "rollout_is_threshold='high': must be a number"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_1.0_2.0"],
     "rollout_is_threshold='0.5_1.0_2.0': must be a number or"),
    ([f"{RC}.rollout_rs=token_k1"], f"{RC}.rollout_rs=token_k1 needs {RC}.rollout_rs_threshold"),
    ([f"{RC}.rollout_rs=seq_sum_k1", f"{RC}.rollout_rs_threshold=0"],
     f"{RC}.rollout_rs='seq_sum_k1', {RC}.rollout_rs_threshold='0': rollout_rs_threshold '0' of seq_sum_k1: "
     "bounds must be > 0"),
    ([f"{RC}.rollout_rs=seq_sum_k1", f"{RC}.rollout_rs_threshold=0.5"],
     "rollout_rs_threshold '0.5' of seq_sum_k1: the upper bound must be >= 1"),
    ([f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=1.1_3.0"],
     "rollout_rs_threshold '1.1_3.0' of seq_mean_k1: the band must hold 1"),
    ([f"{RC}.rollout_rs=seq_max_k1", f"{RC}.rollout_rs_threshold=2"], "rollout_rs option 'seq_max_k1' is not one of"),
    ([f"{RC}.rollout_rs=token_k1,seq_maxk2", f"{RC}.rollout_rs_threshold=2"],
     "rollout_rs option 'seq_maxk2' is not one of"),
    ([f"{RC}.rollout_rs=seq_max_k2", f"{RC}.rollout_rs_threshold=0.5_2.0"],
     "rollout_rs_threshold '0.5_2.0' of seq_max_k2: an upper bound on its divergence, one number"),
    ([f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0"], "rollout_rs_threshold '0' of seq_mean_k3: must be > 0"),
    ([f"{RC}.rollout_rs=token_k1,seq_mean_k3", "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,0.01,3'"],
     "rollout_rs_threshold='0.5_2.0,0.01,3' gives 3 thresholds for 2 options"),
    ([f"{RC}.rollout_is=geometric"], f"{RC}.rollout_is: 'geometric' is not one of 'token', 'sequence'"),
    ([f"{RC}.rollout_is_batch_normalize=true"],
     f"{RC}.rollout_is_batch_normalize=true normalises importance weights, but {RC}.rollout_is=null makes none"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true", f"{RC}.bypass_mode=true"],
     f"{RC}.rollout_is_batch_normalize=true with {RC}.bypass_mode=true"),
    ([f"{RC}.loss_type=reinforce"], f"{RC}.loss_type=reinforce is the loss of bypass mode ({RC}.bypass_mode=true)"),
    ([f"{RC}.loss_type=a2c"], f"{RC}.loss_type: 'a2c' is not one of 'ppo_clip', 'reinforce'"),
    ([f"{RC}.bypass_mode=true", "actor_rollout_ref.actor.tis_imp_ratio_cap=2"],
     f"{RC}.bypass_mode=true makes the rollout's log-probs the old ones: "
     "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0 would weigh every token by 1"),
    ([f"{RC}.bypass_mode=true", "distillation.enabled=true"],
     f"{RC}.bypass_mode=true skips the trainer's log-prob pass that distillation.enabled=true reads"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, expected):
    assert expected in fails(*overrides)


def test_bypass_mode_replaces_another_loss_mode_with_a_warning_as_verl_does(caplog):
    """verl 0.9.1's apply_bypass_mode sets policy_loss.loss_mode="bypass_mode" and runs (issue 52:
    verl's grpo_qwen35_35b_megatron_async.sh runs GSPO's loss_mode under the fully async defaults)."""
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = ok(f"{RC}.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo")
    assert config.algorithm.rollout_correction.bypass_mode
    assert any("replaces actor_rollout_ref.actor.policy_loss.loss_mode=gspo" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("correction", [f"{RC}.rollout_is=token", f"{RC}.rollout_is=sequence",
                                        f"{RC}.rollout_rs=token_k1"])
def test_a_correction_with_the_rollouts_log_probs_as_the_old_ones_is_refused_naming_both(correction):
    """use_rollout_log_probs makes pi_old = pi_rollout: every ratio the corrections read is 1."""
    message = fails(correction, f"{RC}.rollout_rs_threshold=2", "actor_rollout_ref.actor.use_rollout_log_probs=true")
    assert correction in message and "actor_rollout_ref.actor.use_rollout_log_probs=true" in message


def test_the_older_cap_and_verls_weights_are_refused_together_naming_both():
    message = fails("actor_rollout_ref.actor.tis_imp_ratio_cap=2", f"{RC}.rollout_is=token")
    assert "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0" in message and f"{RC}.rollout_is=token" in message
    # the cap with a mask is one weight and one mask: accepted, as is either spelling alone
    ok("actor_rollout_ref.actor.tis_imp_ratio_cap=2", f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2")
    ok("actor_rollout_ref.actor.tis_imp_ratio_cap=2")
    ok(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2")


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_verls_importance_weights_are_the_off_policy_correction_async_modes_need(mode, caplog):
    """Without a correction the async modes warn (as verl does; issue 52), naming rollout_is."""
    split = ["placement.mode=split", "placement.rollout_gpus=4", f"async_training.mode={mode}"]

    def warnings(*overrides):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megarl.config"):
            ok(*overrides)
        return " ".join(r.getMessage() for r in caplog.records if "off-policy" in r.getMessage())

    assert "algorithm.rollout_correction.rollout_is=token|sequence" in warnings(*split)
    assert not warnings(*split, f"{RC}.rollout_is=sequence")
    assert ok(*split, f"{RC}.rollout_is=sequence").algorithm.rollout_correction.rollout_is == "sequence"
    # a mask alone leaves the gradient the behaviour policy's: still warned about
    assert f"async_training.mode={mode}" in warnings(*split, f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=2")
    # bypass mode's PPO ratio is to the rollout policy (as use_rollout_log_probs); its REINFORCE needs weights
    assert not warnings(*split, f"{RC}.bypass_mode=true")
    assert f"async_training.mode={mode}" in warnings(*split, f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce")
    assert not warnings(*split, f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence")


@pytest.mark.parametrize("spec, reciprocal, band", [
    ("2.0", False, (None, 2.0)),  # a TIS cap
    ("0.5_5", False, (0.5, 5.0)),  # IcePop's band
    ("4", True, (0.25, 4.0)),  # a lone upper bound of a mask: [1/U, U], as verl
    ("0.8_1.25", True, (0.8, 1.25)),
    ("1_1", True, (1.0, 1.0)),
])
def test_threshold_strings_parse_as_verl_writes_them(spec, reciprocal, band):
    assert parse_band(spec, reciprocal=reciprocal) == band


def test_the_section_maps_onto_the_keyword_arguments():
    config = ok(f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=0.5_2.0", f"{RC}.rollout_rs=seq_mean_k1",
                f"{RC}.rollout_rs_threshold=1.5")
    kwargs = rollout_correction_kwargs(config.algorithm.rollout_correction)
    assert kwargs.pop("rejection") == [("seq_mean_k1", pytest.approx(1 / 1.5), 1.5)]
    assert kwargs == {"rollout_is": "sequence", "is_lower": 0.5, "is_upper": 2.0, "is_batch_normalize": False}
    off = ok().algorithm.rollout_correction
    assert not off.enabled and rollout_correction_kwargs(off) == {"rollout_is": None, "is_batch_normalize": False,
                                                                  "rejection": []}
    assert bypass_kwargs(off) is None


def test_option_lists_take_one_threshold_for_all_or_one_each_as_verl():
    """verl's decoupled_k3_rs_token_tis-like lists: repeats dropped in order, a lone threshold shared."""
    assert parse_rejection("token_k1, seq_mean_k3,token_k1", "0.5_2.0,0.01") == [
        ("token_k1", 0.5, 2.0), ("seq_mean_k3", None, 0.01)]
    assert parse_rejection("seq_sum_k2,seq_max_k3", "0.3") == [("seq_sum_k2", None, 0.3), ("seq_max_k3", None, 0.3)]
    assert parse_rejection("token_k1,seq_sum_k1", "4") == [("token_k1", 0.25, 4.0), ("seq_sum_k1", 0.25, 4.0)]
    config = ok(f"{RC}.rollout_rs=token_k1,seq_max_k2", "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,0.2'")
    assert rollout_correction_kwargs(config.algorithm.rollout_correction)["rejection"] == [
        ("token_k1", 0.5, 2.0), ("seq_max_k2", None, 0.2)]


def test_bypass_mode_is_accepted_with_its_loss_types_and_maps_to_the_loss():
    config = ok(f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence",
                f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=0.999_1.001")
    assert bypass_kwargs(config.algorithm.rollout_correction) == {
        "loss_type": "reinforce", "correction": {"rollout_is": "sequence", "is_lower": None, "is_upper": 2.0,
                                                 "is_batch_normalize": False,
                                                 "rejection": [("seq_mean_k1", 0.999, 1.001)]}}
    # bypass compares the current policy with the rollout's: use_rollout_log_probs is then no conflict
    ok(f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token", "actor_rollout_ref.actor.use_rollout_log_probs=true")
