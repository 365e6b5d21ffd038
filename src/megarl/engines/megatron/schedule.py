"""Micro-batches through megatron's pipeline schedule (`get_forward_backward_func`: no pipelining,
1F1B, or interleaved with VPP), with a head applied on the last stage."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

from megarl.engines.megatron.mtp import mtp_labels
from megarl.engines.megatron.sequences import MicroBatch

# head(mb, hidden [N, H] at the N response positions of mb) -> (loss [0-dim], outputs)
Head = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict]]


def run_schedule(chunks: list, micro_batches: list[MicroBatch], head: Head, forward_only: bool,
                 before_forward: Optional[Callable[[MicroBatch, int], None]] = None,
                 after_forward: Optional[Callable[[MicroBatch, int], None]] = None, mtp: bool = False) -> list:
    """Run `micro_batches` through the model `chunks` (one per virtual stage; DDP-wrapped to
    train). On the last pipeline stage `head` gets each micro-batch's hidden states at its
    response positions; the list of its outputs comes back there ([] on other stages). Without
    `forward_only`, megatron back-propagates each loss divided by the number of micro-batches
    (gradients accumulate in the DDP buffers). `before_forward(mb, chunk)` and `after_forward(mb,
    chunk)` run around each micro-batch's forward on each model chunk (index into `chunks`; routing
    replay sets the routers' targets there). `mtp`: the model trains its multi-token-prediction
    layers; a training pass hands it their labels (megarl.engines.megatron.mtp)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.train(not forward_only)

    def forward_step(data_iterator, model):
        chunk, mb = next(data_iterator)
        if before_forward is not None:
            before_forward(mb, chunk)
        labels = dict(zip(("labels", "loss_mask"), mtp_labels(mb))) if mtp and not forward_only else {}
        hidden = model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                       packed_seq_params=mb.packed_seq_params, **labels)
        if after_forward is not None:
            after_forward(mb, chunk)
        return hidden, functools.partial(_apply_head, head, mb)

    from megatron.core import parallel_state

    shapes = [mb.input_ids.shape for mb in micro_batches]
    # the whole sequence's length: megatron divides it by CP (and by TP with sequence parallelism)
    # for the shapes it sends between stages (pipeline_parallel/schedules.py `get_tensor_shapes`)
    cp = parallel_state.get_context_parallel_world_size()
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([(index, mb) for mb in micro_batches]) for index in range(len(chunks))],
            model=chunks,
            num_microbatches=len(micro_batches),
            seq_length=max(s[1] for s in shapes) * cp,
            micro_batch_size=max(s[0] for s in shapes),
            forward_only=forward_only,
        )


def _apply_head(head: Head, mb: MicroBatch, hidden: torch.Tensor):
    """Select the hidden states ([S, b, H] or [T, 1, H]) that predict response tokens, then run the head."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return head(mb, flat.index_select(0, mb.token_index))
