"""The RL maths as pure torch functions: no I/O, no communication, no config objects.

advantages  estimators by name (gae, grpo, rloo, remax, reinforce_plus_plus(_baseline), gpg)
losses      policy losses (PPO, GSPO, GPG, DPPO-TV/KL, SAPO, CISPO, Clip-Cov, KL-Cov, GMPO, DRO), value loss,
            actor loss, loss aggregation modes
metrics     Metrics: the losses' metrics, each declared with how it combines over micro-batches
kl          KL estimators (k1/k2/k3, ...), KL in the reward, fixed/adaptive KL controllers
entropy     per-token entropy from logits, also from vocabulary-parallel shards
dpo         DPO (sigmoid, IPO) losses
dapo        dynamic sampling (group filter) and the soft overlong penalty
masked      masked sum/mean/var/whiten
rollout_correction  rollout/trainer mismatch (verl's rollout_corr_helper): truncated IS (token, sequence),
            IcePop, rejection (k1/k2/k3 per token, row sum/mean/max), off-policy diagnostics
opd         on-policy distillation: the teacher's reverse KL (or verl's other distillation losses) in the
            advantage or backpropagated directly (pure or beside RL)
from_config config sections -> keyword arguments

Where megarl differs from verl's `core_algos` (the implementation users compare with), on purpose:

- Group of one response (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, GPG): advantage 0. verl takes
  mean 0 and std 1 there, so the lone response's advantage is its raw score (GPG's: times alpha).
- REINFORCE++-baseline, a group whose scores are all equal: advantage exactly 0 after the batch
  whitening (verl whitens the zeros too, giving them -mean/std).
- A response's outcome score sums its token rewards over `response_mask` only (verl sums every
  position); a reward placed on a masked token does not count. (A token the rollout correction
  rejected still counts: `compute_advantages`'s `score_mask`, as verl's row sum counts it.)
- GSPO honours `loss_agg_mode` (as verl 0.9.1's `compute_policy_loss_gspo` does, though its
  docstring recommends seq-mean-token-mean); the sequence ratio averages the tokens' log-ratios
  unclamped and clamps only the sequence's at 10, as verl. `ppo_kl` is the mean of old - new,
  each token's clamped as the mode's loss clamps it (as verl's: to +-20 in vanilla, sapo, cispo,
  dppo; unclamped in gspo, clip_cov, kl_cov, geo_mean, dro); `approx_kl` (megarl only) always
  uses the +-20-clamped log-ratio.
- geo_mean (GMPO) averages the responses' losses over the mini-batch's responses with a valid
  token (`num_seqs`), so its micro-batches and DP ranks add up to the mini-batch's loss as in every
  other mode. verl's `torch.mean` averages each micro-batch over all its rows (a row without a
  valid token, e.g. rejected whole by rollout_rs, included) and its engine sums the micro-batches:
  the same loss where a mini-batch is one micro-batch on one rank with a response in every row.
  (sapo and geo_mean ignore `loss_agg_mode` as verl's do; clip_cov / kl_cov pick their tokens per
  micro-batch, as verl's.)
- Metric names keep one meaning across loss modes: verl's `pg_clipfrac_lower` is the dual clip in
  vanilla (megarl's `pg_clipfrac_dual`) but the clipped share with A < 0 in geo_mean (megarl's
  `pg_clipfrac_low`, verl's geo_mean `pg_clipfrac` being megarl's `pg_clipfrac_high`); kl_cov's
  `ppo_kl` in verl is the mean |log ratio| (megarl's `ppo_kl_abs`). `policy_loss` lists them.
- Padding is selected away with `torch.where` (verl multiplies by the mask), so NaN or inf in a
  padded position never reaches a result; a reduction over nothing (empty batch, a row without a
  valid token, agg_loss denominators below 1) is 0, never NaN; seq-mean modes count only rows
  with a valid token (verl's `torch.mean` counts every row).

Not a difference: REINFORCE++'s discounted return skips masked positions inside a response (a
tool's reply in a multi-turn episode), returns_t = r_t + gamma * returns_next valid token, as verl
0.9.1's `compute_reinforce_plus_plus_outcome_advantage` carries its running return across
observation tokens. (verl 0.7 and earlier restarted it at every masked position.)
"""
from megarl.algos.advantages import ADV_ESTIMATOR_REGISTRY, AdvantageResult, compute_advantages
from megarl.algos.dapo import (
    DynamicSampler,
    DynamicSamplingExhausted,
    filter_informative_groups,
    overlong_penalty,
)
from megarl.algos.dpo import dpo_loss
from megarl.algos.entropy import entropy_from_logits, vocab_parallel_entropy_partial
from megarl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_penalty,
    make_kl_controller,
)
from megarl.algos.losses import LOSS_AGG_MODES, actor_loss, agg_loss, policy_loss, value_loss
from megarl.algos.metrics import Metrics, Reduction

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "AdaptiveKLController",
    "AdvantageResult",
    "DynamicSampler",
    "DynamicSamplingExhausted",
    "FixedKLController",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "Metrics",
    "Reduction",
    "actor_loss",
    "agg_loss",
    "apply_kl_in_reward",
    "compute_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "filter_informative_groups",
    "kl_penalty",
    "make_kl_controller",
    "overlong_penalty",
    "policy_loss",
    "value_loss",
    "vocab_parallel_entropy_partial",
]
