"""Map sections of the experiment config to the keyword arguments of the algos functions.

The algos functions take plain arguments; these helpers read a config section by attribute
(`megarl.config.schema`) so the loop can write `actor_loss(..., **actor_loss_kwargs(cfg.actor))`.
"""
from __future__ import annotations

from typing import Any, Optional

from megarl.algos.kl import KLController, make_kl_controller
from megarl.config.rules.rollout_correction import parse_band, parse_rejection


def advantage_kwargs(algorithm: Any) -> dict[str, Any]:
    """algorithm.* -> compute_advantages keywords (besides the tensors and uids)."""
    return {"gamma": algorithm.gamma, "lam": algorithm.lam, "norm_adv_by_std_in_grpo": algorithm.norm_adv_by_std_in_grpo}


def actor_loss_kwargs(actor: Any) -> dict[str, Any]:
    """actor_rollout_ref.actor.* -> actor_loss keywords; an unset clip_ratio_low/high means clip_ratio."""
    pl = actor.policy_loss
    return {
        "clip_ratio_low": actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low,
        "clip_ratio_high": actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high,
        "clip_ratio_c": actor.clip_ratio_c,
        "loss_agg_mode": actor.loss_agg_mode,
        "loss_mode": pl.loss_mode,
        "mode_options": {"tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg, "clip_cov_ratio": pl.clip_cov_ratio,
                         "clip_cov_lb": pl.clip_cov_lb, "clip_cov_ub": pl.clip_cov_ub,
                         "kl_cov_ratio": pl.kl_cov_ratio, "ppo_kl_coef": pl.ppo_kl_coef, "dro_beta": pl.dro_beta},
        "tis_imp_ratio_cap": actor.tis_imp_ratio_cap,
        "entropy_coeff": actor.entropy_coeff,
        "use_kl_loss": actor.use_kl_loss,
        "kl_loss_coef": actor.kl_loss_coef,
        "kl_loss_type": actor.kl_loss_type,
    }


def rollout_correction_kwargs(rollout_correction: Any) -> dict[str, Any]:
    """algorithm.rollout_correction -> `rollout_correction` keywords (the threshold strings as bounds)."""
    rc = rollout_correction
    kwargs: dict[str, Any] = {"rollout_is": rc.rollout_is, "is_batch_normalize": rc.rollout_is_batch_normalize,
                              "rejection": []}
    if rc.rollout_is is not None:
        kwargs["is_lower"], kwargs["is_upper"] = parse_band(rc.rollout_is_threshold, reciprocal=False)
    if rc.rollout_rs is not None:
        kwargs["rejection"] = parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
    return kwargs


def bypass_kwargs(rollout_correction: Any) -> Optional[dict[str, Any]]:
    """algorithm.rollout_correction -> `actor_loss`'s `bypass`: {"loss_type", "correction" (the
    `rollout_correction` keywords)}, or None outside bypass mode."""
    if not rollout_correction.bypass_mode:
        return None
    return {"loss_type": rollout_correction.loss_type, "correction": rollout_correction_kwargs(rollout_correction)}


def value_loss_kwargs(critic: Any) -> dict[str, Any]:
    """critic.* -> value_loss keywords."""
    return {"cliprange_value": critic.cliprange_value, "loss_agg_mode": critic.loss_agg_mode}


def kl_controller(kl_ctrl: Any) -> KLController:
    """algorithm.kl_ctrl -> the fixed or adaptive controller of the in-reward KL coefficient."""
    return make_kl_controller(kl_ctrl.type, kl_ctrl.kl_coef, target_kl=kl_ctrl.target_kl, horizon=kl_ctrl.horizon)
