"""Rules on the actor's policy loss mode and the options only some modes read (verl 0.9.1's
`actor.policy_loss.*`, `actor.tau_pos/tau_neg`; megarl.algos.losses.policy_loss)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig

ACTOR = "actor_rollout_ref.actor"
VERL_CLIP_RATIO = 0.2  # verl 0.9.1's actor.yaml: clip_ratio, clip_ratio_low and clip_ratio_high
# the modes that aggregate the policy loss their own way, whatever actor.loss_agg_mode says
OWN_AGGREGATION = {"sapo": "seq-mean-token-mean (verl's compute_policy_loss_sapo)",
                   "geo_mean": "the mean over responses of each response's loss (verl's compute_policy_loss_geo_mean)"}


def mode_option_problems(loss_mode: str, *, tau_pos: float, tau_neg: float, clip_cov_ratio: float,
                         kl_cov_ratio: float, ppo_kl_coef: float, dro_beta: Optional[float]) -> list[tuple[str, str]]:
    """(option, why) for each option `loss_mode` reads whose value it cannot use: SAPO's temperatures
    > 0 (its gate divides by them), Clip-Cov's share > 0 (verl asserts it), KL-Cov's share in (0, 1]
    (verl asserts > 0; above 1 its torch.topk asks for more tokens than there are) and coefficient
    >= 0 (a penalty), DRO's beta given and > 0 (verl raises otherwise). Options of other modes are
    not read, as in verl. `policy_loss_options` names the config keys; megarl.algos.losses.policy_loss
    raises on them."""
    problems = []
    if loss_mode == "sapo":
        problems += [(name, "SAPO's gate temperature must be > 0")
                     for name, value in (("tau_pos", tau_pos), ("tau_neg", tau_neg)) if value <= 0]
    elif loss_mode == "clip_cov" and clip_cov_ratio <= 0:
        problems.append(("clip_cov_ratio", "must be > 0"))
    elif loss_mode == "kl_cov":
        if not 0 < kl_cov_ratio <= 1:
            problems.append(("kl_cov_ratio", "the share of tokens penalised must lie in (0, 1]"))
        if ppo_kl_coef < 0:
            problems.append(("ppo_kl_coef", "a penalty coefficient must be >= 0"))
    elif loss_mode == "dro" and (dro_beta is None or dro_beta <= 0):
        problems.append(("dro_beta", "DRO needs the penalty's coefficient, > 0"))
    return problems


def policy_loss_options(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The options of the loss mode in use hold values it can use (`mode_option_problems`).

    Reads: actor_rollout_ref.actor.policy_loss, actor_rollout_ref.actor.tau_pos, actor_rollout_ref.actor.tau_neg
    """
    actor = config.actor_rollout_ref.actor
    pl = actor.policy_loss
    keys = {"tau_pos": (f"{ACTOR}.tau_pos", actor.tau_pos), "tau_neg": (f"{ACTOR}.tau_neg", actor.tau_neg),
            **{name: (f"{ACTOR}.policy_loss.{name}", getattr(pl, name))
               for name in ("clip_cov_ratio", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")}}
    for name, why in mode_option_problems(pl.loss_mode, **{n: value for n, (_, value) in keys.items()}):
        key, value = keys[name]
        yield f"{key}={value}: {why} ({ACTOR}.policy_loss.loss_mode={pl.loss_mode})"


def loss_mode_aggregates_itself(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """sapo and geo_mean aggregate the policy loss their own way, as verl's do: an
    actor.loss_agg_mode other than theirs applies to the entropy and KL terms only.

    Reads: actor_rollout_ref.actor.policy_loss.loss_mode, actor_rollout_ref.actor.loss_agg_mode
    """
    actor = config.actor_rollout_ref.actor
    own = OWN_AGGREGATION.get(actor.policy_loss.loss_mode)
    if own and not (actor.policy_loss.loss_mode == "sapo" and actor.loss_agg_mode == "seq-mean-token-mean"):
        yield (f"{ACTOR}.policy_loss.loss_mode={actor.policy_loss.loss_mode} aggregates the policy loss by {own}; "
               f"{ACTOR}.loss_agg_mode={actor.loss_agg_mode} applies to the entropy and KL terms only")


def clip_ratio_alone_differs_from_verl(config: ExperimentConfig, sizes: Optional[DerivedSizes]) -> Iterator[str]:
    """(Read before the config is resolved.) `actor.clip_ratio` set without `clip_ratio_low` / `clip_ratio_high`: megarl clips at clip_ratio on
    the side left unset, where verl 0.9.1 still clips at 0.2 (its actor.yaml sets clip_ratio_low and
    clip_ratio_high to 0.2, and compute_policy_loss_vanilla reads clip_ratio only for a bound that is None).

    Reads: actor_rollout_ref.actor.clip_ratio, actor_rollout_ref.actor.clip_ratio_low,
    actor_rollout_ref.actor.clip_ratio_high
    """
    actor = config.actor_rollout_ref.actor
    unset = [name for name in ("clip_ratio_low", "clip_ratio_high") if getattr(actor, name) is None]
    if actor.clip_ratio != VERL_CLIP_RATIO and unset:
        yield (f"{ACTOR}.clip_ratio={actor.clip_ratio} without {ACTOR}.{' / '.join(unset)}: megarl clips at "
               f"{actor.clip_ratio} there; verl 0.9.1 would clip at {VERL_CLIP_RATIO} (its actor.yaml sets "
               "clip_ratio_low and clip_ratio_high, which its loss reads before clip_ratio)")
