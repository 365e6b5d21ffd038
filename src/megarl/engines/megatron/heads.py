"""Heads applied to the last stage's hidden states: token log-probs and entropy through the
(vocabulary-parallel) output layer, and the critic's scalar value head.

The log-prob head never holds the logits of a whole micro-batch: it walks the selected tokens in
chunks of about `LOGITS_CHUNK_ELEMENTS` logits, computes each chunk's logits in the model dtype,
upcasts that chunk to float32, and reduces it across tensor-parallel ranks (max, sum of exp,
target logit, entropy). Under autograd each chunk is recomputed in the backward pass
(activation checkpointing), so only [chunk, V/TP] logits are alive at any time.

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


def _tp():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()


def _chunk_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int, temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) of one chunk of tokens; hidden [n, H], weight [V/TP, H]."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group, rank = _tp()
    shard = weight.shape[0]
    start = rank * shard
    logits = torch.matmul(hidden, weight.t()).float() / temperature  # [n, V/TP]
    beyond_vocab = torch.arange(start, start + shard, device=logits.device) >= vocab_size
    if bool(beyond_vocab.any()):
        logits = logits.masked_fill(beyond_vocab, float("-inf"))
    peak = logits.detach().amax(-1)
    if group.size() > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak[:, None]
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1))
    lse = sum_exp.log()
    local = (targets >= start) & (targets < start + shard)
    picked = shifted.gather(1, (targets - start).clamp(0, shard - 1)[:, None]).squeeze(1)
    target_logit = reduce_from_tensor_model_parallel_region(torch.where(local, picked, 0.0))
    log_prob = target_logit - lse
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
    [V/TP, H] (rank k holds rows k*V/TP ..). Every TP rank returns the same values."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    hidden = copy_to_tensor_model_parallel_region(hidden)  # backward: sum the vocab shards' input grads
    step = max(1, chunk_elements // output_weight.shape[0])
    log_probs, entropies = [], []
    for start in range(0, hidden.shape[0], step):
        args = (hidden[start : start + step], output_weight, targets[start : start + step], vocab_size, temperature,
                with_entropy)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_log_probs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_log_probs(*args)
        log_probs.append(lp)
        entropies.append(ent)
    if not log_probs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(log_probs), (torch.cat(entropies) if with_entropy else None)


def token_values(hidden: torch.Tensor, value_weight: torch.Tensor) -> torch.Tensor:
    """Float32 values [N] of hidden states [N, H] through the scalar head [1, H] (replicated on TP
    ranks, like the hidden states, so no communication is needed)."""
    return torch.matmul(hidden, value_weight.t()).squeeze(-1).float()
