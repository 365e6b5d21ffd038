"""Context parallelism (CP) in megarl's data path: which positions of a sequence each CP rank holds,
which response tokens it scores, and the gather of their per-token values back to whole sequences.

megatron-core's layout (megatron/training/utils.py `get_batch_on_this_cp_rank`, the layout
transformer-engine's CP attention and megatron's RoPE, `get_pos_emb_on_this_cp_rank`, assume): a
sequence of S positions is cut into 2 x CP chunks of S / (2 CP); CP rank r holds chunks r and
2 CP - 1 - r, in that order, so that every rank gets the same share of causal attention work.
Packed sequences (THD) are cut the same way one sequence at a time: each is padded to a multiple
of 2 CP (`cu_seqlens_padded`) and rank r holds chunks r and 2 CP - 1 - r of every sequence, the
sequences in order (transformer-engine's `get_batch_on_this_cp_rank` for "thd", attention/
dot_product_attention/context_parallel.py; megatron's RoPE reads the same split,
models/common/embeddings/rope_utils.py `_get_thd_freqs_on_this_cp_rank`).

Each CP rank's model returns the hidden states of its own positions only; a head scores the
response tokens predicted there (`CpTokens.slots[rank]`), and `gather_tokens` all-gathers those
per-token values so that every CP rank holds every token's value and computes the same loss. Its
backward keeps this rank's tokens' gradient only: every CP rank back-propagates the same loss, and
each token's value depends on the weights through the rank that computed it (plus the keys and
values other ranks' attention read, which the attention's all-gather sends back, cp_attention.py).
The gradients of a replica's CP ranks therefore add up to the loss's gradient; megatron's DDP
averages them over data x context parallel ranks (distributed_data_parallel.py: scaling factor
1 / dp_cp_group.size()), and its schedule multiplies each loss by the CP size to undo the CP part
(training.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


def positions_of_rank(length: int, cp: int, rank: int) -> torch.Tensor:
    """[length / cp] int64: the sequence positions CP rank `rank` holds, in its order (chunk
    `rank`, then chunk 2 cp - 1 - rank, of 2 cp equal chunks). `length` must be a multiple of 2 cp."""
    if cp == 1:
        return torch.arange(length)
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions cannot be cut into 2 x {cp} equal context-parallel chunks")
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def thd_positions_of_rank(cu_seqlens_padded: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """[T / cp] int64: the rows of a packed sequence of T = `cu_seqlens_padded`[-1] tokens that CP
    rank `rank` holds, in its order: for each sequence in turn, its chunk `rank` then its chunk
    2 cp - 1 - rank. Every sequence's padded length must be a multiple of 2 cp."""
    starts = cu_seqlens_padded.long().cpu()
    if cp == 1:
        return torch.arange(int(starts[-1]))
    lengths = starts[1:] - starts[:-1]
    if bool((lengths % (2 * cp)).any()):
        i = int((lengths % (2 * cp)).nonzero()[0])
        raise ValueError(f"packed sequence {i} of {int(lengths[i])} positions cannot be cut into 2 x {cp} equal "
                         "context-parallel chunks (cu_seqlens_padded must pad each sequence to a multiple of 2 CP)")
    return torch.cat([start + positions_of_rank(int(n), cp, rank) for start, n in zip(starts[:-1], lengths)]
                     + [torch.zeros(0, dtype=torch.long)])


@dataclass(frozen=True)
class CpTokens:
    """Which of a micro-batch's N response tokens (row-major (sample, response position) order,
    as `MicroBatch.targets`) each CP rank scores: `slots[r]` [N_r] int64, in the order of that
    rank's hidden-state rows; `rank` is this rank's CP rank."""

    slots: tuple[torch.Tensor, ...]
    rank: int

    @property
    def total(self) -> int:
        return sum(int(s.numel()) for s in self.slots)


def split_tokens(rows: torch.Tensor, held: Sequence[torch.Tensor], rank: int) -> tuple[CpTokens, torch.Tensor]:
    """Tokens read from the whole micro-batch's flattened hidden states at `rows` [N] -> (which CP
    rank reads each: `CpTokens`, and this rank's rows of its own flattened hidden states for its
    tokens). `held[r]`: the whole micro-batch's rows CP rank r holds, in its order
    (`MicroBatch.cp_rows`)."""
    total = sum(int(h.numel()) for h in held)
    owner, local = torch.full((total,), -1, dtype=torch.long), torch.empty(total, dtype=torch.long)
    for r, mine in enumerate(held):
        owner[mine], local[mine] = r, torch.arange(mine.numel())
    rows = rows.long().cpu()
    if bool((owner[rows] < 0).any()):
        raise ValueError("a token is read at a row no CP rank holds")
    tokens = CpTokens(tuple((owner[rows] == r).nonzero().squeeze(1) for r in range(len(held))), rank)
    return tokens, local[rows[tokens.slots[rank]]]


class _GatherTokens(torch.autograd.Function):
    """Forward: every CP rank's [N_r, ...] values, all-gathered and put in token order [N, ...].
    Backward: this rank's tokens' rows of the gradient (see the module docstring)."""

    @staticmethod
    def forward(ctx, values, cp: CpTokens, group):
        ctx.cp = cp
        counts = [int(s.numel()) for s in cp.slots]
        padded = values.new_zeros((max(counts), *values.shape[1:]))
        padded[: values.shape[0]] = values
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded.contiguous(), group=group)  # gloo: equal sizes only
        out = values.new_empty((cp.total, *values.shape[1:]))
        for piece, slots, n in zip(pieces, cp.slots, counts):
            out[slots.to(out.device)] = piece[:n]
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.cp.slots[ctx.cp.rank].to(grad.device)], None, None


def gather_tokens(values: torch.Tensor, cp: CpTokens) -> torch.Tensor:
    """This CP rank's per-token `values` [N_r, ...] -> every token's [N, ...] on every CP rank."""
    from megatron.core import parallel_state

    return _GatherTokens.apply(values, cp, parallel_state.get_context_parallel_group())
