"""KL estimators between the policy and the reference model, and the KL coefficient controllers.

Estimators take per-token log-probabilities of the sampled tokens (`[batch, response_len]`) and
return a per-token estimate of KL(policy || reference) (Schulman, "Approximating KL divergence",
2020). With d = log_prob - ref_log_prob:

    kl, k1        d                             unbiased, can be negative
    abs           |d|
    mse, k2       d^2 / 2                       >= 0
    low_var_kl, k3  exp(-d) - 1 + d             >= 0, unbiased, low variance; -d is clamped to
                                                [-20, 20] and the result to [0, 10] as verl does
"""
from __future__ import annotations

import math
from typing import Union

import torch

from megarl.algos.masked import masked_mean

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate of the kind `kl_type` (one of KL_ESTIMATORS)."""
    diff = log_prob - ref_log_prob
    if kl_type in ("kl", "k1"):
        return diff
    if kl_type == "abs":
        return diff.abs()
    if kl_type in ("mse", "k2"):
        return 0.5 * diff.square()
    if kl_type in ("low_var_kl", "k3"):
        neg = torch.clamp(-diff, min=-20.0, max=20.0)
        # expm1(x) - x avoids the cancellation in exp(x) - 1 - x for small x.
        return torch.clamp(torch.expm1(neg) - neg, min=0.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kl_type!r}; choose from {list(KL_ESTIMATORS)}")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: after each step, value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon,
    where kl is the measured KL (nats per token) and n the number of samples in the step."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0:
            raise ValueError(f"adaptive KL controller: target_kl={target_kl} must be > 0")
        if horizon <= 0:
            raise ValueError(f"adaptive KL controller: horizon={horizon} must be > 0")
        self.value = float(kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


KLController = Union[FixedKLController, AdaptiveKLController]


def make_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> KLController:
    """`kind` is "fixed" or "adaptive" (algorithm.kl_ctrl.type)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {kind!r}; choose 'fixed' or 'adaptive'")


@torch.no_grad()
def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_type: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards = token_level_scores - kl_coef * kl_t on every valid token (0 on padding).

    Returns the rewards and metrics: `kl` is the batch mean of each response's token-mean KL (the
    value to pass to `KLController.update`), `kl_coef` the coefficient used.
    """
    valid = response_mask.bool()
    kl = torch.where(valid, kl_penalty(old_log_prob, ref_log_prob, kl_type), 0.0)
    rewards = torch.where(valid, token_level_scores - kl_coef * kl.to(token_level_scores.dtype), 0.0)
    per_response = masked_mean(kl.double(), response_mask, dim=-1)
    current_kl = float(per_response.mean()) if per_response.numel() else 0.0
    if not math.isfinite(current_kl):
        raise FloatingPointError(f"KL in reward is {current_kl}: check old_log_prob and ref_log_prob for inf/NaN")
    return rewards, {"kl": current_kl, "kl_coef": float(kl_coef)}
