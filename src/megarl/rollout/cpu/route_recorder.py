"""The CPU engine's routed experts: forward hooks on a transformers MoE model's routers record which
experts each token went to, the routes SGLang returns with `--enable-return-routed-experts`
(the wire format and its contract: `rollout.routed_experts`).
"""
from __future__ import annotations

from typing import Optional

import torch


def hf_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The HF model's router modules in layer order (transformers 5: `*TopKRouter`, whose forward
    returns (logits, weights, indices [tokens, top_k]): Qwen3-MoE, Qwen2-MoE and Mixtral)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RouteRecorder:
    """Forward hooks on an HF MoE model's routers: after a forward on a [B, T] input, `take(B, T)`
    returns [B, T, layers, top_k] int32, the experts each token was routed to in each layer."""

    def __init__(self, model: torch.nn.Module):
        routers = hf_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE router (*TopKRouter) to record routes from")
        self._per_layer: list[Optional[torch.Tensor]] = [None] * len(routers)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, layer: int):
        def record(_module, _inputs, outputs):
            self._per_layer[layer] = outputs[2].detach().to(torch.int32)
        return record

    def take(self, batch: int, length: int) -> torch.Tensor:
        routes = torch.stack(self._per_layer, dim=1)  # [B*T, layers, top_k]
        self._per_layer = [None] * len(self._per_layer)
        return routes.reshape(batch, length, *routes.shape[1:])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
