"""Whether the actor's update may leave out the rows whose advantages are all exactly 0
(`actor_rollout_ref.actor.skip_zero_advantage_rows`; megarl.engines.megatron.training.rows_to_train).

Such a row adds exactly 0 to the advantage-weighted policy loss and to its gradient, so long as
the loss is normalised by the whole mini-batch's token and sequence counts (the update keeps those):
each policy loss mode of ZERO_AT_ZERO_ADVANTAGE multiplies each token's term by its
advantage A (vanilla and gspo: max(-A r, -A clip(r)), and for A < 0 only the dual clip; gpg:
-A log pi; dppo_tv / dppo_kl: -A min(r, c) log pi on the kept tokens, 0 elsewhere; sapo: -A g(r);
cispo: -sg[clip(r)] A log pi; geo_mean: -mean_t(A) exp(...) per response), and so do the
weights of truncated IS (`tis_imp_ratio_cap`), the controller's `rollout_is_weights` and bypass
mode's losses (ppo_clip: the vanilla loss; reinforce: -A w log pi). tests/algos/test_skip_rows.py
checks each: loss and gradient exactly 0 at A = 0. Leaving the rows out is therefore exact only
where no other term of the actor's loss reads them; this module names each one that does.

Not a term of this loss: the critic (its own update, on every row), the in-reward KL (inside the
advantages). Dropout draws other masks once the rows differ, as it does with any other cut of the
micro-batches: the same update in distribution, not bit for bit.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig

KEY = "actor_rollout_ref.actor.skip_zero_advantage_rows"
# the modes of megarl.algos.losses.POLICY_LOSS_MODES whose loss and gradient are 0 at A = 0 with the whole
# mini-batch's counts kept (a mode added there is not skipped until it is checked and listed here). Not listed:
# dro (its penalty beta/2 (log r)^2 is on every row), kl_cov (its penalty and clip_cov's cut are drawn by the
# covariance over the micro-batch's tokens, and their counts are the micro-batch's)
ZERO_AT_ZERO_ADVANTAGE = ("vanilla", "gspo", "gpg", "dppo_tv", "dppo_kl", "sapo", "cispo", "geo_mean")


def skip_rows_problems(config: ExperimentConfig, *, moe: Optional[bool]) -> list[str]:
    """Why leaving the zero-advantage rows out of the actor's update would change it, one message
    per key ([] where it is exact). `moe`: whether the actor's model has experts (None: not known
    here, the router-loss keys are then not read: the engine, which reads the model, checks them)."""
    arr = config.actor_rollout_ref
    actor, problems = arr.actor, []
    section = "actor_rollout_ref.actor"
    if actor.use_kl_loss:
        problems.append(f"{section}.use_kl_loss=true (the KL to the reference is a loss on every row)")
    if actor.entropy_coeff != 0:
        problems.append(f"{section}.entropy_coeff={actor.entropy_coeff} (the entropy bonus is a loss on every row)")
    if actor.policy_loss.loss_mode not in ZERO_AT_ZERO_ADVANTAGE:
        problems.append(f"{section}.policy_loss.loss_mode={actor.policy_loss.loss_mode!r} (not known to be 0 at "
                        "advantage 0)")
    rc = config.algorithm.rollout_correction
    if rc.bypass_mode and rc.loss_type == "reinforce" and rc.rollout_is is not None and rc.rollout_is_batch_normalize:
        problems.append("algorithm.rollout_correction.rollout_is_batch_normalize=true in bypass_mode with "
                        "loss_type=reinforce (the weights are normalised over the micro-batch's rows)")
    d = config.distillation
    if d.enabled and not d.use_policy_gradient:
        problems.append("distillation.use_policy_gradient=false (the distillation loss is a loss on every row)")
    if arr.model.mtp.enable and arr.model.mtp.enable_train:
        problems.append("actor_rollout_ref.model.mtp.enable_train=true (the MTP loss is a loss on every row)")
    if moe:
        m = actor.megatron
        if m.moe_aux_loss_coeff > 0:
            problems.append(f"{section}.megatron.moe_aux_loss_coeff={m.moe_aux_loss_coeff} (the router's "
                            "load-balancing loss is over every row's tokens)")
        if m.moe_z_loss_coeff:
            problems.append(f"{section}.megatron.moe_z_loss_coeff={m.moe_z_loss_coeff} (the router's z-loss is "
                            "over every row's tokens)")
        rate = m.override_transformer_config.get("moe_router_bias_update_rate")
        if rate:  # megatron's finalize_model_grads moves the expert bias by the tokens the routers saw
            problems.append(f"{section}.megatron.override_transformer_config.moe_router_bias_update_rate={rate} "
                            "(the expert bias moves with every row's routing)")
    return problems


def skips_zero_advantage_rows(config: ExperimentConfig, *, moe: bool) -> bool:
    """The setting for an actor whose model `moe` has experts or not: auto skips where
    `skip_rows_problems` finds nothing, true always (ValueError naming the keys where it is not
    exact: the router-loss keys, which the config rule cannot read), false never."""
    setting = config.actor_rollout_ref.actor.skip_zero_advantage_rows
    problems = skip_rows_problems(config, moe=moe)
    if setting is True and problems:
        raise ValueError(f"{KEY}=true: not exact with {'; '.join(problems)}; set it to auto or false")
    return setting is True or (setting == "auto" and not problems)


def skips_in_update(skipping: bool, setting, old_from_separate_trainer_pass: bool) -> bool:
    """Whether one update of an actor whose setting resolved to `skipping` (`skips_zero_advantage_rows`)
    leaves the rows out. With auto, not where the old log-probs are the trainer's own from a separate pass
    before the update (`old_from_separate_trainer_pass`): the update's first pass then recomputes them bit
    for bit over the same micro-batches (step 1's ppo_kl exactly 0, ratio exactly 1), which micro-batches
    holding fewer rows change in the last bits (1.6e-7 in ppo_kl, tests/sglang/test_grpo_e2e.py). Where the
    update makes them itself, or they are the rollout's (bypass mode, use_rollout_log_probs), it skips."""
    return skipping and (setting is True or not old_from_separate_trainer_pass)


def skip_rows_exact(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """`skip_zero_advantage_rows=true` only where leaving the zero-advantage rows out changes no
    update (`skip_rows_problems`; the MoE router losses are checked by the engine, which reads the model).

    Reads: actor_rollout_ref.actor.skip_zero_advantage_rows, actor_rollout_ref.actor.use_kl_loss,
    actor_rollout_ref.actor.entropy_coeff, actor_rollout_ref.actor.policy_loss.loss_mode,
    algorithm.rollout_correction, distillation.enabled, distillation.use_policy_gradient,
    actor_rollout_ref.model.mtp
    """
    if config.actor_rollout_ref.actor.skip_zero_advantage_rows is not True:
        return
    problems = skip_rows_problems(config, moe=None)
    if problems:
        yield f"{KEY}=true: not exact with {'; '.join(problems)}; set it to auto (skips where exact) or false"
