"""Rules of the asynchronous training modes (`async_training.*`, megarl.trainer.async_rollout)."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig


def async_modes_fit_the_loop(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Overlapping generation with training needs servers of their own (split placement: colocated,
    the servers release their memory while the engines train, so nothing could overlap), one batch
    of prompts per step (no DAPO rounds, no ReMax greedy baseline, no agent episodes) and, in
    fully_async, a staleness bound of at least one version. Partial rollouts (a push interrupting
    the generation in flight) belong to fully_async (one_step_off's fixed schedule waits for it).

    Reads: async_training.mode, async_training.max_staleness, async_training.partial_rollout, placement.mode,
    algorithm.filter_groups.enable, algorithm.adv_estimator, actor_rollout_ref.rollout.agent.path
    """
    a = config.async_training
    if a.partial_rollout and a.mode != "fully_async":
        yield (f"async_training.partial_rollout=true needs async_training.mode=fully_async, not "
               f"async_training.mode={a.mode}")
    if a.mode == "sync":
        return
    if config.placement.mode != "split":
        yield (f"async_training.mode={a.mode} overlaps generation with training: it needs placement.mode=split "
               f"(with placement.rollout_gpus=N), not placement.mode={config.placement.mode}")
    if a.mode == "fully_async" and a.max_staleness < 1:
        yield (f"async_training.max_staleness={a.max_staleness}: fully_async needs at least 1 (weight versions); "
               "0 is async_training.mode=sync")
    if config.algorithm.filter_groups.enable:
        yield f"algorithm.filter_groups.enable=true is not supported with async_training.mode={a.mode} (use sync)"
    if config.algorithm.adv_estimator == "remax":
        yield f"algorithm.adv_estimator=remax is not supported with async_training.mode={a.mode} (use sync)"
    if config.actor_rollout_ref.rollout.agent.path:
        yield f"actor_rollout_ref.rollout.agent.path is not supported with async_training.mode={a.mode} (use sync)"


def async_modes_correct_off_policy(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """In one_step_off and fully_async the batch was sampled by older weights (1..max_staleness
    versions) than the trainer's. By default the trainer recomputes the old log-probs under its
    current weights; without the importance weight min(exp(old - rollout), cap) per token the policy
    gradient is then that of the behaviour policy, not the trained one (NeMo-RL's async GRPO likewise
    requires `use_importance_sampling_correction`; AReaL's decoupled loss, verl's `rollout_correction`).
    The other correction is the rollout's own log-probs as the old ones (`use_rollout_log_probs`,
    verl's one-step-off and fully async recipes): the PPO ratio is then the importance weight itself.
    So the async modes want one of the two; verl 0.9's importance weights
    (`algorithm.rollout_correction.rollout_is`, token or sequence) count as the first, its bypass
    mode with the PPO loss (`bypass_mode`, `loss_type=ppo_clip`: the ratio to the rollout's
    log-probs) as the second. A warning (megarl.config.rules.WARNING_RULES), not a refusal: verl
    runs such a config, and so does megarl.

    Reads: async_training.mode, actor_rollout_ref.actor.tis_imp_ratio_cap,
    actor_rollout_ref.actor.use_rollout_log_probs, algorithm.rollout_correction.rollout_is,
    algorithm.rollout_correction.bypass_mode, algorithm.rollout_correction.loss_type
    """
    actor, rc = config.actor_rollout_ref.actor, config.algorithm.rollout_correction
    mode, cap = config.async_training.mode, actor.tis_imp_ratio_cap
    weighted = cap > 0 or rc.rollout_is is not None
    rollout_ratio = actor.use_rollout_log_probs or (rc.bypass_mode and rc.loss_type == "ppo_clip")
    if mode != "sync" and not weighted and not rollout_ratio:
        yield (f"async_training.mode={mode} trains on samples from older weights without an off-policy "
               "correction (the gradient is then the behaviour policy's); to correct it set "
               f"actor_rollout_ref.actor.tis_imp_ratio_cap >= 1 (e.g. 2.0; not {cap}), "
               "algorithm.rollout_correction.rollout_is=token|sequence, "
               "actor_rollout_ref.actor.use_rollout_log_probs=true or algorithm.rollout_correction.bypass_mode=true "
               "with loss_type=ppo_clip")
