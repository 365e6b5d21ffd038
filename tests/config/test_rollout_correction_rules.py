"""algorithm.rollout_correction at load time: its refusals, one by one, and its keyword arguments."""
import logging

import pytest

from megarl.algos.from_config import rollout_correction_kwargs
from megarl.config.rules.rollout_correction import parse_band

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
    ([f"{RC}.rollout_rs=seq_sum_k1", f"{RC}.rollout_rs_threshold=0"], "rollout_rs_threshold='0': bounds must be > 0"),
    ([f"{RC}.rollout_rs=seq_sum_k1", f"{RC}.rollout_rs_threshold=0.5"],
     "rollout_rs_threshold='0.5': the upper bound must be >= 1"),
    ([f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=1.1_3.0"],
     "rollout_rs_threshold='1.1_3.0': the band must hold 1"),
    ([f"{RC}.rollout_rs=seq_max_k2", f"{RC}.rollout_rs_threshold=2"], f"{RC}.rollout_rs: 'seq_max_k2' is not one of"),
    ([f"{RC}.rollout_is=geometric"], f"{RC}.rollout_is: 'geometric' is not one of 'token', 'sequence'"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true"],
     f"{RC}.rollout_is_batch_normalize=true: megarl does not normalise the weights"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, expected):
    assert expected in fails(*overrides)


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
    assert rollout_correction_kwargs(config.algorithm.rollout_correction) == pytest.approx({
        "rollout_is": "sequence", "is_lower": 0.5, "is_upper": 2.0,
        "rollout_rs": "seq_mean_k1", "rs_lower": 1 / 1.5, "rs_upper": 1.5})
    off = ok().algorithm.rollout_correction
    assert not off.enabled and rollout_correction_kwargs(off) == {"rollout_is": None, "rollout_rs": None}
