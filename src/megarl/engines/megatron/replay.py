"""Routing replay ("R3") in megarl's megatron engine: the rollout's routed experts forced on
megatron-core's routers (`transformer/moe/router_replay.py`, `moe_enable_routing_replay`).

The batch carries `prompt_routed_experts` [B, P, L, K] and `routed_experts` [B, R, L, K]
(megarl.trainer.experience.routed_experts_grids; the last response token has no route recorded).
A micro-batch's routes are laid out as megatron's routers see their tokens: the router flattens
the hidden states [S, b, H] (padded) or [T, 1, H] (packed) to rows s * b + j, so
`MicroBatch.routes` is [L, S * b or T, K]. Positions without a recorded route (padding, the last
response token) get experts 0..K-1: their outputs never reach a scored token (causal attention,
no token dropping), so any distinct experts do.
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl.data.batch import Batch

REPLAY_KEYS = ("prompt_routed_experts", "routed_experts")


def token_routes(part: Batch) -> torch.Tensor:
    """[T_real, L, K] int64: the routes of `part`'s real tokens (prompt then response of sample 0,
    then sample 1, ...): the order of `megarl.data.packing.pack`. Each sample's last token has no
    recorded route: it gets 0..K-1."""
    real = torch.cat([part["prompt_mask"], part.response_tokens()], 1).bool()
    routes = torch.cat([part["prompt_routed_experts"], part["routed_experts"]], 1)[real].long()
    last = real.sum(1).cumsum(0) - 1  # each sample's last real token, in packed order
    routes[last[real.any(1)]] = torch.arange(routes.shape[-1])
    return routes


def micro_batch_routes(part: Batch, token_rows: torch.Tensor, total_rows: int) -> torch.Tensor:
    """[L, total_rows, K] int64 for megatron's routers: the routes of `part`'s real tokens (in
    `token_routes` order) at their rows `token_rows` [T_real] of the micro-batch's flattened hidden
    states (padded layout: position s of sample j at row s * sequences + j; packed: the sample's
    first row + s; `MicroBatch.routed_rows` holds the same rows)."""
    routes = token_routes(part)
    layers, k = routes.shape[1:]
    out = torch.arange(k).repeat(total_rows, layers, 1)
    out[token_rows] = routes
    return out.transpose(0, 1).contiguous()


def router_rows(total: int, tp: int, tp_rank: int, sequence_parallel: bool,
                held_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n] int64: the rows of a micro-batch's flattened hidden states [S * b or T] (`total` of them)
    that this rank's MoE routers see, in the order they see them.

    With context parallelism the model holds this CP rank's positions only (`held_rows`, in its row
    order: `MicroBatch.held_rows`). With sequence parallelism megatron then splits those rows evenly
    along the sequence over the TP ranks (tensor_parallel/mappings.py `_split_along_first_dim`, via
    `scatter_to_sequence_parallel_region`) and the MoE layer routes that part (transformer/moe/moe_layer.py:
    the router runs before the dispatcher gathers across TP): TP rank r sees the r-th of TP equal
    consecutive runs. Without either, every rank routes every row."""
    rows = torch.arange(total) if held_rows is None else held_rows
    if not sequence_parallel:
        return rows
    if rows.numel() % tp:
        raise ValueError(f"{rows.numel()} token rows cannot be split evenly over {tp} sequence-parallel ranks")
    part = rows.numel() // tp
    return rows[tp_rank * part: (tp_rank + 1) * part]


def moe_routers(chunks: list) -> list[tuple[int, torch.nn.Module]]:
    """(global layer index, router module) of every MoE layer of this rank's chunks."""
    found = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                found.append((layer.layer_number - 1, router))
    return found


def replay_routers(chunks: list) -> list[tuple[int, object]]:
    """(global layer index, its router's `RouterReplay`) for every MoE layer of this rank's chunks."""
    return [(layer, router.router_replay) for layer, router in moe_routers(chunks)
            if getattr(router, "router_replay", None) is not None]


def set_replay(routers: list[tuple[int, object]], routes: Optional[torch.Tensor]) -> None:
    """Force `routes` [L, tokens, K] on the routers for the next forward (REPLAY_FORWARD; a full
    recomputation in the backward pass of the same micro-batch sees the same target), or, with
    None, let them route on their own. One target per router: set it before each forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, replay in routers:
        replay.clear_indices()
        if routes is None:
            replay.clear_router_replay_action()
        else:
            replay.set_target_indices(routes[layer])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
