"""Expert load of a mixture-of-experts model: how evenly tokens are spread over the experts."""
from __future__ import annotations

import torch


def expert_load(routes: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Load metrics of `routes` [N, layers, top_k] (the experts each of N tokens went to, per
    layer; every (token, k) pair counts once for its expert):
    moe/tokens_per_expert_max   the most tokens any expert of any layer got
    moe/tokens_per_expert_mean  N x top_k / num_experts (the same in every layer)
    moe/load_imbalance          max / mean tokens per expert, averaged over layers (1: balanced)
    """
    n, layers, k = routes.shape
    if n == 0:
        return {}
    offsets = torch.arange(layers, device=routes.device)[None, :, None] * num_experts
    counts = torch.bincount((routes.long() + offsets).reshape(-1), minlength=layers * num_experts)
    counts = counts.reshape(layers, num_experts).double()
    mean = n * k / num_experts
    return {"moe/tokens_per_expert_max": counts.max().item(), "moe/tokens_per_expert_mean": mean,
            "moe/load_imbalance": (counts.max(1).values / mean).mean().item()}
