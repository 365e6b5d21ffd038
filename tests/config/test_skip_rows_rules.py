"""`actor_rollout_ref.actor.skip_zero_advantage_rows`: auto skips the zero-advantage rows only where
that leaves the update as it is, true is refused naming each key that makes it inexact, false never
skips (megarl.config.rules.skip_rows; why each key: tests/algos/test_skip_rows.py)."""
import pytest

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.rules.skip_rows import skip_rows_problems, skips_in_update, skips_zero_advantage_rows

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
KEY = "actor_rollout_ref.actor.skip_zero_advantage_rows"
ACTOR = "actor_rollout_ref.actor"
RC = "algorithm.rollout_correction"

# overrides -> the key each message names (model-independent: read at config time)
INEXACT = {
    "kl_loss": ([f"{ACTOR}.use_kl_loss=true"], f"{ACTOR}.use_kl_loss=true"),
    "entropy_bonus": ([f"{ACTOR}.entropy_coeff=0.01"], f"{ACTOR}.entropy_coeff=0.01"),
    "direct_distillation": (["distillation.enabled=true", "distillation.use_policy_gradient=false"],
                            "distillation.use_policy_gradient=false"),
    "mtp_training": (["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true"],
                     "actor_rollout_ref.model.mtp.enable_train=true"),
    "bypass_reinforce_batch_normalized": (
        [f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=token",
         f"{RC}.rollout_is_batch_normalize=true"], f"{RC}.rollout_is_batch_normalize=true"),
}
# read only for a model with experts
MOE_INEXACT = {
    "aux_loss": ([f"{ACTOR}.megatron.moe_aux_loss_coeff=0.01"], f"{ACTOR}.megatron.moe_aux_loss_coeff=0.01"),
    "z_loss": ([f"{ACTOR}.megatron.moe_z_loss_coeff=0.001"], f"{ACTOR}.megatron.moe_z_loss_coeff=0.001"),
    "expert_bias_updates": ([f"+{ACTOR}.megatron.override_transformer_config.moe_router_bias_update_rate=0.001"],
                            "moe_router_bias_update_rate=0.001"),
}
# exact: what the loss terms above leave out, or what is no term of the actor's loss
EXACT = {
    "defaults": [],
    "gspo_dr_grpo": [f"{ACTOR}.policy_loss.loss_mode=gspo", f"{ACTOR}.loss_agg_mode=seq-mean-token-sum-norm"],
    "tis": [f"{ACTOR}.tis_imp_ratio_cap=2.0"],
    "bypass_ppo_clip_batch_normalized": [f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token",
                                         f"{RC}.rollout_is_batch_normalize=true"],
    "rollout_is_before_the_update": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true"],
    "distillation_in_the_advantage": ["distillation.enabled=true"],
    "mtp_drafting_only": ["actor_rollout_ref.model.mtp.enable=true"],
    "kl_in_the_reward": ["algorithm.use_kl_in_reward=true"],
    "critic": ["critic.enable=true", "algorithm.adv_estimator=gae"],
    "entropy_coeff_zero_written": [f"{ACTOR}.entropy_coeff=0.0", f"{ACTOR}.use_kl_loss=false"],
}


def _config(*overrides: str):
    """With the setting at auto (off by default), which `overrides` may change."""
    return load_config(None, [*REQUIRED, f"{KEY}=auto", *overrides])


@pytest.mark.parametrize("name", EXACT)
def test_auto_skips_where_the_update_stays_the_same(name):
    config = _config(*EXACT[name])
    assert skip_rows_problems(config, moe=True) == []
    assert skips_zero_advantage_rows(config, moe=False) and skips_zero_advantage_rows(config, moe=True)
    assert not skips_zero_advantage_rows(_config(*EXACT[name], f"{KEY}=false"), moe=False)


@pytest.mark.parametrize("name", INEXACT)
def test_each_key_that_reads_the_rows_turns_auto_off_and_true_is_refused_naming_it(name):
    overrides, named = INEXACT[name]
    config = _config(*overrides)
    problems = skip_rows_problems(config, moe=None)
    assert len(problems) == 1 and problems[0].startswith(named)
    assert not skips_zero_advantage_rows(config, moe=False)
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, [*REQUIRED, *overrides, f"{KEY}=true"])
    assert f"{KEY}=true: not exact with {named}" in str(info.value)


@pytest.mark.parametrize("name", MOE_INEXACT)
def test_the_router_losses_count_only_for_a_model_with_experts(name):
    overrides, named = MOE_INEXACT[name]
    config = _config(*overrides)
    assert skip_rows_problems(config, moe=False) == skip_rows_problems(config, moe=None) == []
    assert skips_zero_advantage_rows(config, moe=False)
    [problem] = skip_rows_problems(config, moe=True)
    assert named in problem
    assert not skips_zero_advantage_rows(config, moe=True)
    forced = load_and_validate(None, [*REQUIRED, *overrides, f"{KEY}=true"])  # the config cannot tell
    assert skips_zero_advantage_rows(forced, moe=False)
    with pytest.raises(ValueError, match=f"{KEY}=true: not exact with .*{named}"):
        skips_zero_advantage_rows(forced, moe=True)  # the engine, which reads the model, refuses it


def test_several_keys_are_named_together():
    config = _config(f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.entropy_coeff=0.01")
    assert [p.split(" ")[0] for p in skip_rows_problems(config, moe=None)] == [
        f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.entropy_coeff=0.01"]


def test_the_setting_takes_auto_true_false_only():
    assert load_config(None, REQUIRED).actor_rollout_ref.actor.skip_zero_advantage_rows is False  # off unless asked
    assert _config().actor_rollout_ref.actor.skip_zero_advantage_rows == "auto"
    assert _config(f"{KEY}=true").actor_rollout_ref.actor.skip_zero_advantage_rows is True
    with pytest.raises(ConfigError, match="'sometimes' is not one of 'auto', True, False"):
        _config(f"{KEY}=sometimes")


@pytest.mark.parametrize("skipping, setting, separate_pass, skips", [
    (True, "auto", False, True),   # old log-probs made in the update, or the rollout's
    (True, "auto", True, False),   # the trainer's own pass: its log-probs recomputed bit for bit
    (True, True, True, True),      # asked for: the update is the same to float rounding
    (False, "auto", False, False),  # not exact for this config
    (False, False, False, False),
])
def test_skipping_in_one_update(skipping, setting, separate_pass, skips):
    assert skips_in_update(skipping, setting, separate_pass) is skips
