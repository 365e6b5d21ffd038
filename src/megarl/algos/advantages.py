"""Advantage estimators, selected by name (`algorithm.adv_estimator`).

Shapes: per-token tensors are `[batch, response_len]` with `response_mask` (1 = real response
token); `reward_baselines` is `[batch]`; `uids` is a sequence of `batch` hashable prompt ids
(responses with the same uid answer the same prompt and form one group). A response's outcome
score is the sum of its token-level rewards over the mask (`score_mask` where given: the tokens the
policy generated, before a rollout rejection mask took some out of `response_mask`, whose rewards
still count, as verl's sum over every position counts them).

Every estimator returns `AdvantageResult(advantages, returns, metrics)`: both tensors are
`[batch, response_len]`, float32 (float64 if the rewards are float64), exactly 0 on padding.
Group estimators give advantage 0 to every response of a group of one response or of a group
whose scores are all equal, and count such groups in `metrics` (never NaN).
"""
from __future__ import annotations

import inspect
from typing import Callable, Hashable, NamedTuple, Optional, Sequence

import torch

from megarl.algos.masked import masked_sum, masked_whiten


class AdvantageResult(NamedTuple):
    advantages: torch.Tensor  # [batch, response_len]
    returns: torch.Tensor  # [batch, response_len]; value targets for gae
    metrics: dict[str, float]


class GroupStats(NamedTuple):
    """Per-sample view of the group statistics of outcome scores (float64, `[batch]` each)."""

    mean: torch.Tensor  # group mean of scores
    std: torch.Tensor  # group standard deviation (Bessel-corrected; 0 for a group of one)
    size: torch.Tensor  # number of responses in the group
    degenerate: torch.Tensor  # bool: group of one, or all scores equal
    metrics: dict[str, float]


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score of each response: the masked sum of its token rewards, float64 `[batch]`."""
    return masked_sum(token_level_rewards.to(torch.float64), response_mask, dim=-1)


def group_indices(uids: Sequence[Hashable], batch_size: int) -> tuple[torch.Tensor, int]:
    """Dense group index per sample (in order of first appearance) and the number of groups."""
    if len(uids) != batch_size:
        raise ValueError(f"uids has {len(uids)} entries but the batch has {batch_size} responses")
    first_seen: dict[Hashable, int] = {}
    index = [first_seen.setdefault(uid, len(first_seen)) for uid in uids]
    return torch.tensor(index, dtype=torch.long), len(first_seen)


def group_stats(scores: torch.Tensor, uids: Sequence[Hashable]) -> GroupStats:
    """Mean, std and degeneracy of each sample's group. `scores` is `[batch]`."""
    scores = scores.to(torch.float64)
    index, num_groups = group_indices(uids, scores.shape[0])
    index = index.to(scores.device)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    size = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / size
    deviation = scores - mean[index]
    var = zeros.index_add(0, index, deviation**2) / (size - 1).clamp(min=1)
    high = zeros.scatter_reduce(0, index, scores, "amax", include_self=False)
    low = zeros.scatter_reduce(0, index, scores, "amin", include_self=False)
    singleton = size < 2
    uniform = (~singleton) & (high == low)
    metrics = {
        "num_groups": float(num_groups),
        "num_singleton_groups": float(singleton.sum()),
        "num_uniform_groups": float(uniform.sum()),
    }
    return GroupStats(mean[index], var.sqrt()[index], size[index], (singleton | uniform)[index], metrics)


def _broadcast(per_sample: torch.Tensor, response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[batch]` -> `[batch, response_len]`, 0 on padding."""
    tokens = per_sample.to(dtype)[:, None].expand(response_mask.shape)
    return torch.where(response_mask.bool(), tokens, 0.0)


@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    gamma: float,
    lam: float,
) -> AdvantageResult:
    """PPO's generalised advantage estimation over response tokens (Schulman et al. 2015).

    delta_t = r_t + gamma * V_next - V_t, A_t = delta_t + gamma * lam * A_next, where "next" is the
    next valid token (padding and masked-out tokens are skipped; after the last valid token
    V_next = A_next = 0). returns = A + V (the critic's targets). The advantages are then whitened
    over all valid tokens of the batch (mean 0, variance 1), as verl does.
    """
    dtype = _work_dtype(token_level_rewards)
    rewards, values = token_level_rewards.to(dtype), values.to(dtype)
    valid = response_mask.bool()
    next_value = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    next_advantage = torch.zeros_like(next_value)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        advantages[:, t] = advantage
    returns = torch.where(valid, advantages + values, 0.0)
    return AdvantageResult(masked_whiten(torch.where(valid, advantages, 0.0), response_mask), returns, {})


@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    uids: Sequence[Hashable],
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    score_mask: Optional[torch.Tensor] = None,
) -> AdvantageResult:
    """GRPO: A_i = (s_i - mean_g) / (std_g + epsilon) on every token of response i, where s is the
    outcome score and mean_g, std_g (Bessel-corrected) are over i's group. With
    `norm_adv_by_std_in_grpo=False` (Dr.GRPO) A_i = s_i - mean_g. returns = advantages.
    """
    scores = sequence_scores(token_level_rewards, response_mask if score_mask is None else score_mask)
    stats = group_stats(scores, uids)
    centred = scores - stats.mean
    per_sample = centred / (stats.std + epsilon) if norm_adv_by_std_in_grpo else centred
    per_sample = torch.where(stats.degenerate, torch.zeros_like(per_sample), per_sample)
    advantages = _broadcast(per_sample, response_mask, _work_dtype(token_level_rewards))
    return AdvantageResult(advantages, advantages, stats.metrics)


@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Hashable],
    score_mask: Optional[torch.Tensor] = None,
) -> AdvantageResult:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean_{j != i} s_j over i's group of n responses,
    which equals n / (n - 1) * (s_i - mean_g). returns = advantages.
    """
    scores = sequence_scores(token_level_rewards, response_mask if score_mask is None else score_mask)
    stats = group_stats(scores, uids)
    per_sample = (scores - stats.mean) * stats.size / (stats.size - 1).clamp(min=1)
    per_sample = torch.where(stats.degenerate, torch.zeros_like(per_sample), per_sample)
    advantages = _broadcast(per_sample, response_mask, _work_dtype(token_level_rewards))
    return AdvantageResult(advantages, advantages, stats.metrics)


@torch.no_grad()
def gpg_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Hashable],
    score_mask: Optional[torch.Tensor] = None,
) -> AdvantageResult:
    """GPG (Chu et al. 2025, verl's `compute_gpg_outcome_advantage`): A_i = alpha * (s_i - mean_g)
    on every token of response i, with alpha = B / M, B the responses of the batch and M those
    whose score s is not 0 (at least 1): the batch's mean gradient rescaled to the responses that
    carry a reward. Not divided by the group's std. returns = advantages.
    """
    scores = sequence_scores(token_level_rewards, response_mask if score_mask is None else score_mask)
    stats = group_stats(scores, uids)
    alpha = scores.shape[0] / scores.count_nonzero().clamp(min=1).to(torch.float64)
    per_sample = torch.where(stats.degenerate, torch.zeros_like(scores), alpha * (scores - stats.mean))
    advantages = _broadcast(per_sample, response_mask, _work_dtype(token_level_rewards))
    return AdvantageResult(advantages, advantages, stats.metrics)


@torch.no_grad()
def remax_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, reward_baselines: torch.Tensor
) -> AdvantageResult:
    """ReMax (Li et al. 2023): returns_t = sum_{k >= t} r_k over valid tokens, A_t = returns_t - b,
    where `reward_baselines` b `[batch]` is the score of the greedy response to the same prompt
    (generated and scored by the loop). Not whitened.
    """
    dtype = _work_dtype(token_level_rewards)
    valid = response_mask.bool()
    rewards = torch.where(valid, token_level_rewards.to(dtype), 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    advantages = torch.where(valid, returns - reward_baselines.to(dtype)[:, None], 0.0)
    return AdvantageResult(advantages, torch.where(valid, returns, 0.0), {})


@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> AdvantageResult:
    """REINFORCE++ (Hu 2025): returns_t = r_t + gamma * returns_next, where "next" is the next
    valid token: masked positions inside a response (a tool's reply in a multi-turn episode) hold
    0 and are skipped, so the return of an earlier policy turn carries the later turns' rewards, as
    in GAE. Then whitened over all valid tokens of the batch. Token-level KL-in-reward, if
    configured, is already inside `token_level_rewards` (see `megarl.algos.kl.apply_kl_in_reward`).
    """
    dtype = _work_dtype(token_level_rewards)
    valid = response_mask.bool()
    rewards = torch.where(valid, token_level_rewards.to(dtype), 0.0)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid[:, t], running, 0.0)
    return AdvantageResult(masked_whiten(returns, response_mask), returns, {})


@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Hashable],
    score_mask: Optional[torch.Tensor] = None,
) -> AdvantageResult:
    """REINFORCE++-baseline: a_i = s_i - mean_g on every token of response i, whitened over all
    valid tokens of the batch; responses of degenerate groups are then set back to exactly 0.
    returns = advantages.
    """
    scores = sequence_scores(token_level_rewards, response_mask if score_mask is None else score_mask)
    stats = group_stats(scores, uids)
    centred = torch.where(stats.degenerate, torch.zeros_like(scores), scores - stats.mean)
    dtype = _work_dtype(token_level_rewards)
    whitened = masked_whiten(_broadcast(centred, response_mask, dtype), response_mask)
    keep = response_mask.bool() & ~stats.degenerate.to(whitened.device)[:, None]
    advantages = torch.where(keep, whitened, 0.0)
    return AdvantageResult(advantages, advantages, stats.metrics)


ADV_ESTIMATOR_REGISTRY: dict[str, Callable[..., AdvantageResult]] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "remax": remax_advantages,
    "reinforce_plus_plus": reinforce_plus_plus_advantages,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline_advantages,
    "gpg": gpg_advantages,
}

_INPUT_HELP = {
    "values": "the critic's values [batch, response_len]",
    "uids": "the prompt uid of every response (responses to one prompt form a group)",
    "reward_baselines": "the greedy response's score per sample [batch]",
}


def zero_advantage_rows(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[batch] bool: the rows whose advantage is exactly 0 at every response token (a row without
    one too): a group of equal scores under a group estimator. NaN is not 0."""
    return (torch.where(response_mask.bool(), advantages, 0.0) == 0).all(-1)


def compute_advantages(
    estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    uids: Optional[Sequence[Hashable]] = None,
    values: Optional[torch.Tensor] = None,
    reward_baselines: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    score_mask: Optional[torch.Tensor] = None,
) -> AdvantageResult:
    """Run the estimator named `estimator` with the inputs it uses; the others are ignored.
    `score_mask` [batch, response_len]: the tokens whose rewards make an outcome score (default
    `response_mask`).

    Raises ValueError for an unknown name or a missing input the estimator needs.
    """
    if estimator not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose from {list(ADV_ESTIMATOR_REGISTRY)}")
    fn = ADV_ESTIMATOR_REGISTRY[estimator]
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [batch, response_len]"
        )
    available = dict(
        uids=uids, values=values, reward_baselines=reward_baselines, gamma=gamma, lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, epsilon=epsilon,
        score_mask=response_mask if score_mask is None else score_mask,
    )
    kwargs = {}
    for name in list(inspect.signature(fn).parameters)[2:]:
        if available[name] is None:
            raise ValueError(f"adv_estimator={estimator!r} needs `{name}`: {_INPUT_HELP[name]}")
        kwargs[name] = available[name]
    return fn(token_level_rewards, response_mask, **kwargs)
