"""Heads applied to the last stage's hidden states: token log-probs and entropy through the
(vocabulary-parallel) output layer, and the critic's scalar value head.

The log-prob head never holds the logits of a whole micro-batch: it walks the selected tokens in
chunks of about `LOGITS_CHUNK_ELEMENTS` logits, computes each chunk's logits in the model dtype,
upcasts that chunk to float32, and reduces it across tensor-parallel ranks (max, sum of exp,
target logit, entropy). Under autograd each chunk is recomputed in the backward pass
(activation checkpointing), so only [chunk, V/TP] logits are alive at any time; but a micro-batch
of at most `KEPT_LOGITS_ELEMENTS` logits, one chunk, keeps its few MiB from the forward instead
(the CPU quickstart's 160 x 128: their recomputation took 3.5 ms of CPU of a 108 ms profiled
update, per rank; with interleaved pipelining several micro-batches' heads may wait for their
backward at once, so large ones stay checkpointed).

Columns past the real vocabulary (megatron pads it to a multiple of 128 x TP) are set to -inf
before the softmax: the padded rows of the output layer are zero, and a 0 logit would otherwise
take probability mass from the real tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megarl.algos.entropy import vocab_parallel_entropy_partial

LOGITS_CHUNK_ELEMENTS = 1 << 26  # float32 logits per chunk (256 MiB)
KEPT_LOGITS_ELEMENTS = 1 << 20  # a micro-batch of at most this many logits (4 MiB) is not recomputed


def _tp():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()


def mask_beyond_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`logits` [..., V/TP] of this TP rank's vocabulary shard with megatron's padding columns, those
    from the checkpoint's `vocab_size` on, set to -inf (never a token); as they are where none is padding."""
    shard = logits.shape[-1]
    start = _tp()[1] * shard
    padding = torch.arange(start, start + shard, device=logits.device) >= vocab_size
    return logits.masked_fill(padding, float("-inf")) if bool(padding.any()) else logits


def _chunk_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) of one chunk of tokens; hidden [n, H], weight [V/TP, H]."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group, rank = _tp()
    shard = weight.shape[0]
    start = rank * shard
    logits = mask_beyond_vocab(torch.matmul(hidden, weight.t()).float() / temperature, vocab_size)  # [n, V/TP]
    peak = logits.detach().amax(-1)
    if group.size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak[:, None]
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1))
    lse = sum_exp.log()
    columns = targets if targets.dim() == 2 else targets[:, None]  # [n, K] (K = 1 for one target per token)
    local = (columns >= start) & (columns < start + shard)
    picked = shifted.gather(1, (columns - start).clamp(0, shard - 1))
    target_logit = reduce_from_tensor_model_parallel_region(torch.where(local, picked, 0.0))
    log_prob = target_logit - lse[:, None]
    if targets.dim() == 1:
        log_prob = log_prob.squeeze(1)
    if not with_entropy:
        return log_prob, torch.zeros_like(log_prob)
    entropy = reduce_from_tensor_model_parallel_region(vocab_parallel_entropy_partial(shifted, lse))
    return log_prob, entropy


def token_log_probs(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Float32 log p(targets) [N] and (with_entropy) the entropy [N] of softmax(logits / temperature)
    over the real vocabulary, for hidden states [N, H] and this rank's output-layer rows
    [V/TP, H] (rank k holds rows k*V/TP ..). Every TP rank returns the same values. `targets` [N, K]
    (several token ids per position, e.g. a teacher's top-k) gives log-probs [N, K]."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    hidden = copy_to_tensor_model_parallel_region(hidden)  # backward: sum the vocab shards' input grads
    step = max(1, chunk_elements // output_weight.shape[0])
    recompute = torch.is_grad_enabled() and (hidden.shape[0] > step
                                             or hidden.shape[0] * output_weight.shape[0] > KEPT_LOGITS_ELEMENTS)
    log_probs, entropies = [], []
    for start in range(0, hidden.shape[0], step):
        args = (hidden[start : start + step], output_weight, targets[start : start + step], vocab_size, temperature,
                with_entropy)
        if recompute:
            lp, ent = checkpoint(_chunk_log_probs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_log_probs(*args)
        log_probs.append(lp)
        entropies.append(ent)
    if not log_probs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(log_probs), (torch.cat(entropies) if with_entropy else None)


@torch.no_grad()
def token_top_k(
    hidden: torch.Tensor,
    output_weight: torch.Tensor,
    targets: torch.Tensor,
    k: int,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(targets) [N], top-k log-probs [N, k] float32 in descending order, their token ids
    [N, k] int64) of softmax(logits / temperature) over the real vocabulary, without gradients;
    hidden [N, H], this rank's output-layer rows [V/TP, H]. Each TP rank takes the top k of its
    shard; the ranks' candidates are gathered and the top k of them kept (the global top k is among
    them). Every TP rank returns the same values."""
    group, rank = _tp()
    shard = output_weight.shape[0]
    start = rank * shard
    step = max(1, chunk_elements // shard)
    sampled, top_values, top_ids = [], [], []
    for first in range(0, hidden.shape[0], step):
        logits = mask_beyond_vocab(torch.matmul(hidden[first : first + step], output_weight.t()).float() / temperature,
                                   vocab_size)
        peak = logits.amax(-1)
        if group.size() > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - peak[:, None]
        sum_exp = shifted.exp().sum(-1)
        if group.size() > 1:
            dist.all_reduce(sum_exp, group=group)
        lse = sum_exp.log()
        chunk_targets = targets[first : first + step]
        local = (chunk_targets >= start) & (chunk_targets < start + shard)
        picked = shifted.gather(1, (chunk_targets - start).clamp(0, shard - 1)[:, None]).squeeze(1)
        picked = torch.where(local, picked, 0.0)
        values, ids = shifted.topk(min(k, shard), dim=-1)
        ids = ids + start
        if group.size() > 1:
            dist.all_reduce(picked, group=group)
            gathered_values = [torch.empty_like(values) for _ in range(group.size())]
            gathered_ids = [torch.empty_like(ids) for _ in range(group.size())]
            dist.all_gather(gathered_values, values, group=group)
            dist.all_gather(gathered_ids, ids, group=group)
            values, ids = torch.cat(gathered_values, -1), torch.cat(gathered_ids, -1)
        values, positions = values.topk(k, dim=-1)
        sampled.append(picked - lse)
        top_values.append(values - lse[:, None])
        top_ids.append(ids.gather(1, positions))
    if not sampled:
        return (hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros((0, k), dtype=torch.float32),
                torch.zeros((0, k), dtype=torch.int64, device=hidden.device))
    return torch.cat(sampled), torch.cat(top_values), torch.cat(top_ids)


def token_values(hidden: torch.Tensor, value_weight: torch.Tensor) -> torch.Tensor:
    """Float32 values [N] of hidden states [N, H] through the scalar head [1, H] (replicated on TP
    ranks, like the hidden states, so no communication is needed)."""
    return torch.matmul(hidden, value_weight.t()).squeeze(-1).float()
