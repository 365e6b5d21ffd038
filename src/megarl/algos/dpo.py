"""Direct preference optimisation losses over whole-response log-probabilities.

Inputs are `[batch]` tensors: the sum over response tokens of the log-probabilities (nats) of the
chosen and of the rejected response, under the policy and under the frozen reference model.
With h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected):

    sigmoid (Rafailov et al. 2023)  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
                                    (eps = label_smoothing; 0 is plain DPO, > 0 is cDPO)
    ipo (Azar et al. 2023)          (h - 1 / (2 beta))^2

The loss is the batch mean.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (loss, metrics); metrics (detached): rewards_chosen and rewards_rejected (batch means
    of beta * (pi - ref)), reward_margin (their difference), reward_accuracy (share of pairs whose
    chosen reward is higher)."""
    if beta <= 0:
        raise ValueError(f"DPO beta={beta} must be > 0")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose from {list(DPO_LOSS_TYPES)}")
    with torch.no_grad():
        chosen_reward = beta * chosen_ratio.detach()
        rejected_reward = beta * rejected_ratio.detach()
        metrics = {
            "dpo_loss": losses.detach().mean(),
            "rewards_chosen": chosen_reward.mean(),
            "rewards_rejected": rejected_reward.mean(),
            "reward_margin": (chosen_reward - rejected_reward).mean(),
            "reward_accuracy": (chosen_reward > rejected_reward).float().mean(),
        }
    return losses.mean(), metrics
