"""A `Batch` of prompt + response samples -> megatron model inputs, one micro-batch at a time.

Each sample becomes one sequence: its real prompt tokens, then its real response tokens (padding
removed, positions from 0). Two layouts of a micro-batch of b sequences:

    padded  input_ids [b, S], right-padded to the longest sequence S; causal attention alone keeps
            padding out of every real token's context. Works with every layer spec.
    packed  input_ids [1, T], the sequences back to back with `PackedSeqParams` (THD, cu_seqlens);
            needs transformer-engine attention (GPU).

The model's last stage returns hidden states [S, b, H] (padded) or [T, 1, H] (packed).
`MicroBatch.token_index` selects, in row-major (sample, response position) order, the hidden
state that predicts each real response token: response token t of a sample whose prompt has p
tokens is predicted at sequence position p - 1 + t.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from megarl.data.batch import Batch
from megarl.data.packing import pack
from megarl.data.partition import token_budget_micro_batches
from megarl.engines.megatron.context_parallel import CpTokens, gather_tokens, positions_of_rank, split_tokens
from megarl.engines.megatron.replay import micro_batch_routes

Layout = Literal["padded", "packed"]


@dataclass
class MicroBatch:
    """Model inputs of some samples of a batch, plus what the heads need to score them."""

    rows: torch.Tensor  # [b] int64: positions of these samples in the batch they came from
    input_ids: torch.Tensor  # [b, S] (padded) or [1, T] (packed)
    position_ids: torch.Tensor  # same shape as input_ids
    packed_seq_params: Optional[object]  # megatron PackedSeqParams (packed layout), else None
    response_mask: torch.Tensor  # [b, R] bool: real response tokens
    token_index: torch.Tensor  # [N] int64: row of the flattened hidden states [S*b or T, H] per real response token
    targets: torch.Tensor  # [N] int64: the real response tokens, row-major
    data: dict[str, torch.Tensor] = field(default_factory=dict)  # the batch's other tensors, these rows
    routes: Optional[torch.Tensor] = None  # [L, S*b or T, K] routing replay (megarl.engines.megatron.replay)
    # every real input token but each sample's last (the positions a rollout engine routes):
    routed_rows: Optional[torch.Tensor] = None  # [M] int64: its row of the flattened hidden states [S*b or T]
    # Context parallelism (CP > 1): input_ids, position_ids [b, S/CP] hold this CP rank's positions;
    # token_index [N_r] and targets [N_r] only the response tokens predicted there (`cp.slots[cp.rank]`);
    # held_rows [S/CP*b]: the row of the whole sequence's flattened hidden states [S*b] of each of this
    # rank's rows (routes and routed_rows keep the whole sequence's rows). None without CP.
    cp: Optional[CpTokens] = None
    held_rows: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        """N, the real response tokens (all CP ranks')."""
        return int(self.response_mask.sum())

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """[N, ...] per real response token -> [b, R, ...], 0 at padding (keeps autograd). With
        context parallelism, [N_r, ...] of this CP rank's tokens, gathered from every CP rank
        first (`context_parallel.gather_tokens`)."""
        if self.cp is not None:
            values = gather_tokens(values, self.cp)
        out = values.new_zeros((*self.response_mask.shape, *values.shape[1:]))
        out[self.response_mask] = values
        return out


def micro_batch_groups(
    lengths: Sequence[int],
    *,
    max_samples: Optional[int] = None,
    max_tokens: Optional[int] = None,
    multiple_of: int = 1,
) -> list[list[int]]:
    """Split sample indices into micro-batches: at most `max_samples` consecutive samples each
    (None: one micro-batch), or, with `max_tokens`, balanced groups of at most that many tokens
    (`megarl.data.partition.token_budget_micro_batches`). The number of micro-batches is rounded
    up to a multiple of `multiple_of` (megatron's interleaved schedule needs a multiple of PP)."""
    n = len(lengths)
    if n == 0:
        raise ValueError("no samples to split into micro-batches")
    if n < multiple_of:
        raise ValueError(
            f"{n} samples cannot fill {multiple_of} micro-batches (the interleaved pipeline schedule needs a "
            "multiple of pipeline_model_parallel_size micro-batches)"
        )
    if max_tokens is not None:
        count = multiple_of
        while True:
            groups = token_budget_micro_batches(list(lengths), max_tokens, min_micro_batches=count)
            if len(groups) % multiple_of == 0:
                return groups
            count = math.ceil(len(groups) / multiple_of) * multiple_of
            if count > n:
                raise ValueError(
                    f"cannot split {n} samples into a multiple of {multiple_of} micro-batches of at most "
                    f"{max_tokens} tokens"
                )
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"micro-batch size must be at least 1, got {max_samples}")
    count = 1 if max_samples is None else math.ceil(n / max_samples)
    count = min(n, math.ceil(count / multiple_of) * multiple_of)
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]
    starts = [sum(sizes[:i]) for i in range(count)]
    return [list(range(s, s + size)) for s, size in zip(starts, sizes)]


def default_sequence_layout(transformer_engine_layers: bool, cp: int) -> Layout:
    """Packed where transformer-engine attention can take it (`PackedSeqParams`, THD) and the role
    has no context parallelism (megarl partitions only padded sequences over CP ranks); else padded."""
    return "packed" if transformer_engine_layers and cp == 1 else "padded"


def length_multiple(tp: int, sequence_parallel: bool, cp: int = 1) -> int:
    """What a micro-batch's sequence length (padded layout) or token count (packed) must be a
    multiple of. With context parallelism, 2 CP (`context_parallel.positions_of_rank`: 2 CP equal
    chunks). With sequence parallelism, each CP rank's S / CP positions split evenly over the TP
    ranks (megatron splits the embeddings' output along the sequence, tensor_parallel/mappings.py
    `_split_along_first_dim`: "First dimension of the tensor should be divisible by tensor parallel
    size"), so S a multiple of CP x TP too."""
    multiple = 2 * cp if cp > 1 else 1
    return math.lcm(multiple, cp * tp) if sequence_parallel else multiple


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def fixed_shape(batch: Batch, groups: Sequence[Sequence[int]], layout: Layout, multiple: int = 1) -> tuple[int, int]:
    """(sequences, tokens) that fit every micro-batch of `groups`: padded layout, the most samples
    of a group and the longest sequence; packed layout, 1 and the most tokens of a group; tokens
    rounded up to a multiple of `multiple` (`length_multiple`)."""
    lengths = batch.token_lengths().tolist()
    if layout == "packed":
        return 1, _round_up(max(sum(lengths[i] for i in g) for g in groups), multiple)
    return max(len(g) for g in groups), _round_up(max(max(lengths[i] for i in g) for g in groups), multiple)


def make_micro_batch(
    batch: Batch,
    rows: Sequence[int],
    layout: Layout,
    vocab_size: int,
    device: torch.device,
    data_keys: Sequence[str] = (),
    shape: Optional[tuple[int, int]] = None,
    with_routes: bool = False,
    multiple: int = 1,
    cp: int = 1,
    cp_rank: int = 0,
) -> MicroBatch:
    """The micro-batch of `batch`'s samples `rows`; `data_keys` are the extra tensors (old
    log-probs, advantages, ...) the head needs, copied to `device`. With `shape` (see
    `fixed_shape`) the inputs are padded to exactly that size: padded layout, extra all-padding
    sequences and columns; packed layout, one extra padding sequence (no response, never scored).
    Without it the sequence length (padded) or token count (packed) is rounded up to a multiple of
    `multiple` (`length_multiple`) the same way. `with_routes`: the batch's routed experts laid out
    for megatron's routers (routing replay). `cp` > 1: the part of CP rank `cp_rank` (padded layout
    only; see `MicroBatch` and `context_parallel`)."""
    if cp > 1 and layout != "padded":
        raise ValueError("context parallelism takes the padded sequence layout (megarl does not partition packed "
                         "sequences over CP ranks)")
    index = torch.as_tensor(list(rows), dtype=torch.long)
    part = batch.select(index)
    packed = pack(part)  # checks that prompt/response tokens are one run each
    lengths = packed.prompt_lens + packed.response_lens
    if bool(((packed.response_lens > 0) & (packed.prompt_lens == 0)).any()):
        row = int(((packed.response_lens > 0) & (packed.prompt_lens == 0)).nonzero()[0])
        raise ValueError(f"sample {int(index[row])} has no prompt token: its first response token has no context")
    bad = (packed.input_ids < 0) | (packed.input_ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(
            f"token id {int(packed.input_ids[bad][0])} is outside the model's vocabulary of {vocab_size} tokens"
        )
    response_mask = part["response_mask"].bool()
    b, width = response_mask.shape
    cols = torch.arange(width)
    predict_at = packed.prompt_lens[:, None] - 1 + cols[None, :]  # [b, R] sequence position predicting each token
    sample_of_token = torch.repeat_interleave(torch.arange(b), lengths)
    routed = packed.position_ids < lengths[sample_of_token] - 1  # all but each sample's last token
    if layout == "padded":
        sequences, longest = shape or (b, _round_up(int(lengths.max()), multiple))
        input_ids = torch.zeros(sequences, longest, dtype=torch.long)
        input_ids[sample_of_token, packed.position_ids] = packed.input_ids
        position_ids = torch.arange(longest).expand(sequences, -1).contiguous()
        flat = predict_at * sequences + torch.arange(b)[:, None]  # hidden states are [S, sequences, H]
        packed_seq_params = None
        route_args = (packed.position_ids, sample_of_token, longest, sequences)
        token_rows = packed.position_ids * sequences + sample_of_token
    elif layout == "packed":
        from megatron.core.packed_seq_params import PackedSeqParams

        total = _round_up(packed.num_tokens, multiple) if shape is None else shape[1]
        filler = total - packed.num_tokens
        input_ids = torch.cat([packed.input_ids, torch.zeros(filler, dtype=torch.long)])[None, :]
        position_ids = torch.cat([packed.position_ids, torch.arange(filler)])[None, :]
        flat = packed.cu_seqlens_padded[:-1, None].long() + predict_at
        cu = packed.cu_seqlens if filler == 0 else torch.cat([packed.cu_seqlens, packed.cu_seqlens.new_tensor([total])])
        packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
            max_seqlen_q=max(packed.max_seqlen, filler), max_seqlen_kv=max(packed.max_seqlen, filler),
        )
        route_args = (None, None, total, 1)
        token_rows = packed.cu_seqlens_padded[sample_of_token].long() + packed.position_ids
    else:
        raise ValueError(f"unknown sequence layout {layout!r}; choose 'padded' or 'packed'")
    targets = part["response_ids"][response_mask].long()
    cp_tokens = held_rows = None
    if cp > 1:
        held = positions_of_rank(longest, cp, cp_rank)
        input_ids, position_ids = input_ids[:, held], position_ids[:, held]
        held_rows = (held[:, None] * sequences + torch.arange(sequences)[None, :]).reshape(-1)
        sample = torch.arange(b)[:, None].expand(b, width)[response_mask]
        cp_tokens, flat = split_tokens(predict_at[response_mask], sample, longest, sequences, cp, cp_rank)
        targets = targets[cp_tokens.slots[cp_rank]]
    else:
        flat = flat[response_mask]
    data = {}
    for key in data_keys:
        if key not in part.tensors:
            raise KeyError(f"the batch has no '{key}' (it has: {', '.join(part.keys())})")
        data[key] = part.tensors[key].to(device)
    return MicroBatch(
        rows=index,
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        packed_seq_params=packed_seq_params,
        response_mask=response_mask.to(device),
        token_index=flat.to(device),
        targets=targets.to(device),
        data=data,
        routes=micro_batch_routes(part, *route_args) if with_routes else None,
        routed_rows=token_rows[routed].to(device),
        cp=cp_tokens,
        held_rows=None if held_rows is None else held_rows.to(device),
    )
