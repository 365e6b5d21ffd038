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


class RouteReplay:
    """Routing replay on the MoE routers of a rank's model chunks, one micro-batch at a time, as
    megatron-core's `RouterReplay` (transformer/moe/router_replay.py, 0.16.1 and 0.19: the same
    API) is made for pipelines, and as verl drives it (verl/workers/engine/megatron/transformer_impl.py
    `forward_step`, verl-project/verl 1dda039b of 2026-08-22):

    - `before_forward(chunk, routes)` sets each of the chunk's routers to REPLAY_FORWARD with the
      micro-batch's routes as its target; `set_target_indices` also appends them to the router's
      FIFO `replay_backward_list`.
    - `after_forward(chunk)` switches the chunk's routers to REPLAY_BACKWARD: a recomputation in
      the backward pass (full, or selective "moe") pops the oldest routes of that FIFO.

    A chunk's backward passes run in the order of its forwards (megatron's no-pipelining, 1F1B and
    interleaved schedules, pipeline_parallel/schedules.py), so each recomputation replays the routes
    of its own micro-batch, although with pipelining later micro-batches' forwards run before it
    (1F1B on stage 0 of 2: F1 F2 B1 F3 B2 ...). Only the chunk that runs the forward gets targets
    (with VPP another chunk's FIFO would take routes it never pops in order). Layers that are not
    recomputed never pop: their FIFO is dropped by `clear` after the schedule."""

    def __init__(self, chunks: list):
        # per chunk: (global layer index, its router's RouterReplay)
        self.routers = [[(layer, router.router_replay) for layer, router in moe_routers([chunk])
                         if getattr(router, "router_replay", None) is not None] for chunk in chunks]

    def __bool__(self) -> bool:
        return any(self.routers)

    def before_forward(self, chunk: int, routes: Optional[torch.Tensor]) -> None:
        """Before a micro-batch's forward on model chunk `chunk`: replay `routes` [L, tokens, K]
        (all L layers; this chunk's routers take their own), or with None let them route on their own."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for layer, replay in self.routers[chunk]:
            if routes is None:
                replay.clear_router_replay_action()
            else:
                replay.set_target_indices(routes[layer])
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk: int) -> None:
        """After a micro-batch's forward on `chunk`: its recomputation, if any, replays from the FIFO."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for _, replay in self.routers[chunk]:
            if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def clear(self) -> None:
        """After the schedule: no targets, no FIFO, the routers route on their own."""
        for replay in (replay for routers in self.routers for _, replay in routers):
            replay.clear_indices()
            replay.clear_router_replay_action()
