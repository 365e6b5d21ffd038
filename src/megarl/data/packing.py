"""Sequence packing: a padded Batch's real tokens back to back, with cu_seqlens (THD layout).

    packed = pack(micro_batch)                       # prompt + response tokens, no padding
    logits = model(packed.input_ids, packed.position_ids, cu_seqlens=packed.cu_seqlens, ...)
    log_probs = unpack_response(token_log_probs, packed, shift=-1)   # [B, R], 0 at padding

Sequence i occupies input_ids[cu_seqlens_padded[i] : cu_seqlens_padded[i] + seq_lens[i]]: its
prompt tokens, then its response tokens. With pad_to_multiple_of > 1 each sequence is followed
by (id 0) padding up to a multiple of that size, as Megatron's THD format wants under sequence
or context parallelism; cu_seqlens counts real tokens, cu_seqlens_padded the padded offsets.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.data.batch import Batch


@dataclass(frozen=True)
class PackedSequences:
    input_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, from 0 within each sequence (padding continues the count)
    cu_seqlens: torch.Tensor  # [n + 1] int32, cumulative real lengths
    cu_seqlens_padded: torch.Tensor  # [n + 1] int32, where each sequence starts in input_ids
    prompt_lens: torch.Tensor  # [n] int64
    response_lens: torch.Tensor  # [n] int64
    max_seqlen: int  # longest sequence, padding included
    response_width: int  # R of the batch that was packed

    @property
    def num_tokens(self) -> int:
        """T, padding included."""
        return self.input_ids.shape[0]


def _check_contiguous(mask: torch.Tensor, name: str, left_padded: bool) -> None:
    """Real tokens must form one run: at the right end (left-padded) or from column 0."""
    m = mask.bool()
    steps = m[:, 1:] & ~m[:, :-1] if not left_padded else ~m[:, 1:] & m[:, :-1]
    if steps.any():
        row = int(steps.any(1).nonzero()[0])
        side = "at the right end (left padding)" if left_padded else "from column 0 (right padding)"
        raise ValueError(f"pack: {name} of sample {row} has a gap; its real tokens must be one run {side}")


def pack(batch: Batch, pad_to_multiple_of: int = 1) -> PackedSequences:
    """Pack the real tokens of `batch` (prompt_ids/prompt_mask, response_ids and
    `Batch.response_tokens()`: response_attention_mask if present, else response_mask)."""
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be at least 1, got {pad_to_multiple_of}")
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    response_ids, response_mask = batch["response_ids"], batch.response_tokens()
    name = "response_attention_mask" if "response_attention_mask" in batch else "response_mask"
    _check_contiguous(prompt_mask, "prompt_mask", left_padded=True)
    _check_contiguous(response_mask, name, left_padded=False)
    device = prompt_ids.device
    prompt_lens = prompt_mask.bool().sum(1)
    response_lens = response_mask.bool().sum(1)
    seq_lens = prompt_lens + response_lens
    padded_lens = (seq_lens + pad_to_multiple_of - 1) // pad_to_multiple_of * pad_to_multiple_of
    zero = torch.zeros(1, dtype=torch.long, device=device)
    cu_seqlens = torch.cat([zero, seq_lens.cumsum(0)])
    cu_padded = torch.cat([zero, padded_lens.cumsum(0)])

    ids = torch.cat([prompt_ids, response_ids], 1)
    real = torch.cat([prompt_mask, response_mask], 1).bool()
    rows = real.nonzero(as_tuple=True)[0]  # row-major: sample 0's tokens first
    rank_in_row = real.long().cumsum(1)[real] - 1
    total = int(cu_padded[-1])
    input_ids = torch.zeros(total, dtype=ids.dtype, device=device)
    input_ids[cu_padded[rows] + rank_in_row] = ids[real]
    starts = torch.repeat_interleave(cu_padded[:-1], padded_lens)
    position_ids = torch.arange(total, device=device) - starts
    return PackedSequences(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens.to(torch.int32),
        cu_seqlens_padded=cu_padded.to(torch.int32),
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        max_seqlen=int(padded_lens.max()) if len(padded_lens) else 0,
        response_width=response_ids.shape[1],
    )


def _response_positions(packed: PackedSequences, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [n, R] bool, flat packed positions of the valid entries, shifted by `shift`)."""
    if shift not in (0, -1):
        raise ValueError(f"shift must be 0 or -1, got {shift}")
    if shift == -1 and bool((packed.prompt_lens[packed.response_lens > 0] == 0).any()):
        raise ValueError("shift=-1 needs at least one prompt token before every response")
    cols = torch.arange(packed.response_width, device=packed.input_ids.device)
    valid = cols[None, :] < packed.response_lens[:, None]
    start = packed.cu_seqlens_padded[:-1].long() + packed.prompt_lens + shift
    positions = (start[:, None] + cols[None, :])[valid]
    return valid, positions


def unpack_response(values: torch.Tensor, packed: PackedSequences, shift: int = 0) -> torch.Tensor:
    """[T, ...] per packed token -> [n, R, ...] per response token, 0 at padding.

    shift=0: values[t] belongs to token t. shift=-1: values[t] belongs to token t + 1 (computed
    from the logits at t, as next-token log-probs and entropies are).
    """
    valid, positions = _response_positions(packed, shift)
    out = values.new_zeros((*valid.shape, *values.shape[1:]))
    out[valid] = values[positions]
    return out


def pack_response(values: torch.Tensor, packed: PackedSequences, shift: int = 0) -> torch.Tensor:
    """[n, R, ...] per response token (advantages, old log-probs) -> [T, ...] per packed token,
    0 on prompt tokens and padding; the inverse of unpack_response with the same shift."""
    valid, positions = _response_positions(packed, shift)
    out = values.new_zeros((packed.num_tokens, *values.shape[2:]))
    out[positions] = values[valid]
    return out
