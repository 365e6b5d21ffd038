"""The RL maths as pure torch functions: no I/O, no communication, no config objects.

advantages  estimators by name (gae, grpo, rloo, remax, reinforce_plus_plus(_baseline))
losses      PPO/GSPO policy loss, value loss, actor loss, loss aggregation modes
metrics     Metrics: the losses' metrics, each declared with how it combines over micro-batches
kl          KL estimators (k1/k2/k3, ...), KL in the reward, fixed/adaptive KL controllers
entropy     per-token entropy from logits, also from vocabulary-parallel shards
dpo         DPO (sigmoid, IPO) losses
dapo        dynamic sampling (group filter) and the soft overlong penalty
masked      masked sum/mean/var/whiten
from_config config sections -> keyword arguments
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
