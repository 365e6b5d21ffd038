"""The CPU engine's routed experts: forward hooks on a transformers MoE model's routers record which
experts each token went to, the routes SGLang returns with `--enable-return-routed-experts`
(the wire format and its contract: `rollout.routed_experts`).
"""
from __future__ import annotations

import re

import torch


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def hf_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, router module) of the HF model's MoE layers, in layer order (transformers 5:
    `*TopKRouter` / DeepSeek-V3's `DeepseekV3TopkRouter`, whose forward returns (logits, weights,
    indices [tokens, top_k]): Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3)."""
    return [(int(_LAYER.search(name).group(1)), m) for name, m in model.named_modules()
            if type(m).__name__.lower().endswith("topkrouter")]


class RouteRecorder:
    """Forward hooks on an HF MoE model's routers: after a forward on a [B, T] input, `take(B, T)`
    returns [B, T, layers, top_k] int32, the experts each token was routed to in each layer, over
    all `num_hidden_layers`: a dense layer's rows are 0, as SGLang's capture buffer leaves them
    (state_capturer/base.py: a zeroed [.., num_hidden_layers, top_k] buffer that
    routed_experts.py `capture(layer_id, ...)` fills for the MoE layers only)."""

    def __init__(self, model: torch.nn.Module):
        routers = hf_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE router (*TopKRouter) to record routes from")
        self._layers = model.config.num_hidden_layers
        self._moe_layers = [layer for layer, _ in routers]
        self._per_layer: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._hook(layer)) for layer, r in routers]

    def _hook(self, layer: int):
        def record(_module, _inputs, outputs):
            self._per_layer[layer] = outputs[2].detach().to(torch.int32)
        return record

    def take(self, batch: int, length: int) -> torch.Tensor:
        first = self._per_layer[self._moe_layers[0]]
        routes = torch.zeros(first.shape[0], self._layers, first.shape[1], dtype=torch.int32)  # [B*T, layers, top_k]
        for layer in self._moe_layers:
            routes[:, layer] = self._per_layer[layer]
        self._per_layer = {}
        return routes.reshape(batch, length, *routes.shape[1:])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
