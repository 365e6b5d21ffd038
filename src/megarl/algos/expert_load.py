"""Expert load of a mixture-of-experts model: how evenly tokens are spread over the experts."""
from __future__ import annotations

import torch


def expert_load(counts: torch.Tensor) -> dict[str, float]:
    """Load metrics of `counts` [layers, num_experts] (the routed (token, k) pairs each expert got in
    each layer, N x top_k per layer for N tokens):
    moe/tokens_per_expert_max   the most tokens any expert of any layer got
    moe/tokens_per_expert_mean  N x top_k / num_experts (the same in every layer)
    moe/load_imbalance          max / mean tokens per expert, averaged over layers (1: balanced)
    """
    counts = counts.double()
    mean = counts[0].mean().item()
    if mean == 0:
        return {}
    return {"moe/tokens_per_expert_max": counts.max().item(), "moe/tokens_per_expert_mean": mean,
            "moe/load_imbalance": (counts.max(1).values / mean).mean().item()}
