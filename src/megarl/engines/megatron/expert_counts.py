"""Expert load from the trainer's own routing: how many of this DP rank's tokens megatron-core's
routers sent to each expert, per MoE layer, summed over the rank's samples (forward hooks on the
routers; with routing replay on, the routes they replay). A total, not per sample: the controller
only needs the step's load, and [L, E] per rank is what crosses Ray ([B, L, E] would be 25 MB of
int32 at B=1024, L=48, E=128).

Counted tokens: every real input token but each sample's last (`MicroBatch.routed_rows`), the
positions a rollout engine routes, so with replay the counts are those of the rollout's routes.
A router's forward returns (probs, routing_map [tokens, experts] bool) with tokens the flattened
hidden states' rows (megatron-core `TopKRouter.forward`) this rank routes (`replay.router_rows`).
Without sequence parallelism every TP rank routes all of them, so the last stage's TP rank 0 has
its layers' counts; with it, each TP rank routes its part of the sequence and the counts are summed
over the TP group; with context parallelism each CP rank routes its own positions, and the counts
are summed over the CP group. The layers of other pipeline stages arrive by a sum over the
pipeline group (zeros elsewhere).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megarl.engines.megatron.replay import moe_routers
from megarl.engines.megatron.sequences import MicroBatch


class ExpertCounter:
    """While open (a `with` block around a forward-only pass over a batch), counts [L, E] int32
    (L: the model's layers, E: its experts) of the routed tokens of all its samples;
    `before_forward(mb)` names the micro-batch the next forward runs on."""

    def __init__(self, chunks: list, num_layers: int, num_experts: int, device: torch.device,
                 rows_of: Callable[[MicroBatch], torch.Tensor] = lambda mb: torch.arange(mb.input_ids.numel())):
        """`rows_of(mb)`: the rows of `mb`'s flattened hidden states this rank's routers see, in
        their order (`replay.router_rows`; all by default)."""
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int32, device=device)
        self._routers = moe_routers(chunks)
        self._rows_of = rows_of
        self._mb = None
        self._handles = []

    def before_forward(self, mb: MicroBatch) -> None:
        self._mb = mb

    def _hook(self, layer: int):
        def count(_module, _inputs, outputs):
            mb = self._mb
            seen, routed = self._rows_of(mb).to(mb.routed_rows.device), mb.routed_rows
            router_row = torch.full((int(torch.cat([seen, routed]).max()) + 1,), -1, dtype=torch.long,
                                    device=routed.device)
            router_row[seen] = torch.arange(seen.numel(), device=routed.device)
            mine = router_row[routed]
            mine = mine[mine >= 0]  # the routed tokens this rank's routers saw, as rows of their input
            hits = outputs[1].index_select(0, mine).to(torch.int32)  # [M, E]
            self.counts[layer] += hits.sum(0, dtype=torch.int32)
        return count

    def __enter__(self) -> ExpertCounter:
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in self._routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def totals(self, *groups) -> torch.Tensor:
        """[L, E] int32 on the CPU, every layer's counts: a sum over each of `groups` (None: skipped):
        the pipeline group, and the groups over which ranks route different tokens (the TP group
        with sequence parallelism, the CP group with context parallelism). Every rank of those
        groups calls this."""
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(self.counts, group=group)
        return self.counts.cpu()
