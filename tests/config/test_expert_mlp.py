"""The expert-module decision (`megarl.config.expert_mlp`), case by case, and its config-time refusals."""
import pytest

from megarl.config import ConfigError, load_and_validate
from megarl.config.expert_mlp import expert_mlp

KEY = "actor_rollout_ref.actor.megatron.moe_grouped_gemm=true cannot run"


# (requested, device, TE layers, TE GroupedLinear) -> the module, or the reason `true` is refused
@pytest.mark.parametrize("requested, device, te_layers, grouped_linear, expected", [
    (None, "cuda", True, True, "grouped"),  # auto: grouped wherever it can run
    (True, "cuda", True, True, "grouped"),
    (False, "cuda", True, True, "sequential"),  # forced off
    (None, "cpu", False, False, "sequential"),
    (None, "cuda", False, False, "sequential"),  # local layer spec (no TE, or LoRA)
    (None, "cuda", True, False, "sequential"),  # TE < 1.9: megatron would build the legacy GroupedMLP
    (False, "cpu", False, False, "sequential"),
    (True, "cpu", False, False, "runs on CUDA only"),
    (True, "cuda", False, True, "local layer spec"),
    (True, "cuda", True, False, "transformer-engine >= 1.9"),
])
def test_expert_mlp_decision(requested, device, te_layers, grouped_linear, expected):
    if expected in ("grouped", "sequential"):
        assert expert_mlp(requested, device, te_layers, grouped_linear, section="actor_rollout_ref.actor") == expected
    else:
        with pytest.raises(ConfigError, match=expected) as info:
            expert_mlp(requested, device, te_layers, grouped_linear, section="actor_rollout_ref.actor")
        assert str(info.value).startswith(KEY)


REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
CPU = ["trainer.device=cpu", "actor_rollout_ref.rollout.name=cpu"]


@pytest.mark.parametrize("overrides, message", [
    ([*CPU, "actor_rollout_ref.actor.megatron.moe_grouped_gemm=true"], f"{KEY}: the role trains on cpu"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.megatron.moe_grouped_gemm=true"],
     "actor_rollout_ref.model.lora.rank=8"),
    ([*CPU, "critic.enable=true", "critic.megatron.moe_grouped_gemm=true"],
     "critic.megatron.moe_grouped_gemm=true cannot run: the role trains on cpu"),
])
def test_grouped_gemm_that_cannot_run_anywhere_is_refused_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, [*REQUIRED, *overrides])
    assert message in str(info.value)


def test_grouped_gemm_auto_off_and_possible_load():
    assert load_and_validate(None, REQUIRED).actor_rollout_ref.actor.megatron.moe_grouped_gemm is None  # auto
    assert load_and_validate(None, [*REQUIRED, *CPU, "actor_rollout_ref.actor.megatron.moe_grouped_gemm=false"])
    # trainer.device=auto: CUDA may have transformer-engine; the engine decides when it starts
    config = load_and_validate(None, [*REQUIRED, "actor_rollout_ref.actor.megatron.moe_grouped_gemm=true"])
    assert config.actor_rollout_ref.ref.megatron.moe_grouped_gemm is True  # the reference follows the actor
