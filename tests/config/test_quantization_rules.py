"""`actor_rollout_ref.rollout.quantization` (verl's key) is checked at load time
(megarl.config.rules.quantization). SGLang's own refusals these rules quote are checked against the
real server in tests/sglang/test_fp8_serving.py and against the CPU engine in tests/rollout/test_fp8_cpu_engine.py."""
import logging

import pytest

from megarl.config import ConfigError, load_and_validate

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
KEY = "actor_rollout_ref.rollout"


def test_fp8_rollout_is_off_by_default_and_loads_with_a_half_precision_server():
    assert load_and_validate(None, REQUIRED).actor_rollout_ref.rollout.quantization is None
    config = load_and_validate(None, REQUIRED + [f"{KEY}.quantization=fp8", f"{KEY}.name=cpu", "trainer.device=cpu"])
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.quantization, rollout.dtype) == ("fp8", "bfloat16")


@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}.quantization=fp8", f"{KEY}.dtype=float32"],
     f"{KEY}.quantization=fp8 needs {KEY}.dtype bfloat16 or float16 (got float32)"),
    ([f"{KEY}.quantization=fp8", f"{KEY}.name=sglang", "trainer.device=cpu"],
     "Fp8LinearMethod on CPU requires that CPU has AMX support"),
    ([f"{KEY}.quantization=torchao"], f"{KEY}.quantization"),  # verl's other value: megarl has fp8 only
])
def test_fp8_rollout_settings_sglang_refuses_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + overrides)
    assert message in str(info.value)


def test_fp8_rollout_without_a_correction_is_warned_about_and_runs(caplog):
    fp8 = REQUIRED + [f"{KEY}.quantization=fp8", f"{KEY}.name=cpu", "trainer.device=cpu"]
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        load_and_validate(None, fp8)
    assert any("quantization=fp8 without a correction" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        load_and_validate(None, fp8 + ["algorithm.rollout_correction.rollout_is=token"])
    assert not any("without a correction" in r.getMessage() for r in caplog.records)
