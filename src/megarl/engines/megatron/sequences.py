"""A `Batch` of prompt + response samples -> megatron model inputs, one micro-batch at a time.

Each sample becomes one sequence: its real prompt tokens, then its real response tokens (padding
removed, positions from 0). Two layouts of a micro-batch of b sequences:

    padded  input_ids [b, S], right-padded to the longest sequence S; causal attention alone keeps
            padding out of every real token's context. Works with every layer spec.
    packed  input_ids [1, T], the sequences back to back with `PackedSeqParams` (THD, cu_seqlens);
            transformer-engine's attention on GPUs, megarl's reference attention on CPU
            (`cp_attention`). With context parallelism each sequence is padded to a multiple
            of 2 CP (`cu_seqlens_padded`), as transformer-engine requires, and a filler sequence
            follows a last sequence that ends in padding (`thd_filler`).

The model's last stage returns hidden states [S, b, H] (padded) or [T, 1, H] (packed).
`MicroBatch.token_index` selects, in row-major (sample, response position) order, the hidden
state that predicts each real response token: response token t of a sample whose prompt has p
tokens is predicted at sequence position p - 1 + t.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal, Optional, Sequence

import torch

from megarl.config.transformer_overrides import KEY as OVERRIDES_KEY
from megarl.config.transformer_overrides import packed_cp_problems
from megarl.data.batch import Batch
from megarl.data.packing import pack
from megarl.data.partition import token_budget_micro_batches
from megarl.engines.megatron.context_parallel import (CpTokens, gather_tokens, positions_of_rank, split_tokens,
                                                      thd_positions_of_rank)
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
    # Context parallelism (CP > 1): input_ids, position_ids [b, S/CP] (padded) or [1, T/CP] (packed) hold
    # this CP rank's positions; token_index [N_r] and targets [N_r] only the response tokens predicted
    # there (`cp.slots[cp.rank]`); cp_rows[r]: the rows of the whole micro-batch's flattened hidden
    # states [S*b or T] CP rank r holds, in its row order (routes and routed_rows keep the whole
    # micro-batch's rows). None without CP.
    cp: Optional[CpTokens] = None
    cp_rows: Optional[tuple[torch.Tensor, ...]] = None
    # packed layout: [b] the row of each sample's first token in the whole packed sequence; None (padded)
    sequence_starts: Optional[torch.Tensor] = None

    @property
    def held_rows(self) -> Optional[torch.Tensor]:
        """This CP rank's rows of the whole micro-batch's flattened hidden states (None without CP)."""
        return None if self.cp is None else self.cp_rows[self.cp.rank]

    def hidden_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """[b] sequence position per sample -> its row of the whole micro-batch's flattened hidden
        states: padded, position * sequences + sample; packed, the sample's first row + position."""
        positions = positions.to(self.rows.device)
        if self.sequence_starts is not None:
            return self.sequence_starts + positions
        return positions * self.input_ids.shape[0] + torch.arange(len(positions))

    @property
    def num_tokens(self) -> int:
        """N, the real response tokens (all CP ranks')."""
        return int(self.response_mask.sum())

    def per_token(self, grid: torch.Tensor) -> torch.Tensor:
        """[b, R, ...] of this micro-batch's samples -> [N, ...] aligned with `targets` (with context
        parallelism, this CP rank's tokens only): the inverse of `to_grid`."""
        values = grid[self.response_mask]
        return values if self.cp is None else values[self.cp.slots[self.cp.rank]]

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


def sequence_layout_problems(layout: Layout, *, section: str, cp: int, cp_comm_type, on_cuda: bool,
                             transformer_engine_layers: bool) -> list[str]:
    """Why role `section` cannot take sequence `layout` here ([] if it can). Packed (THD) sequences
    run in transformer-engine's attention (megatron's local attention asserts `packed_seq_params is
    None`, transformer/dot_product_attention.py), so on a GPU they need transformer-engine layers; on
    CPU megarl's reference attention takes them (`cp_attention`). With CP, only "p2p" takes them
    (`transformer_overrides.packed_cp_problems`), on CPU as on GPUs."""
    if layout not in ("padded", "packed"):
        return [f"{section}: unknown sequence layout {layout!r}; choose 'padded' or 'packed'"]
    if layout == "padded":
        return []
    problems = []
    if on_cuda and not transformer_engine_layers:
        problems.append(f"{section}: packed sequences need transformer-engine attention on a GPU (megatron's local "
                        "attention refuses PackedSeqParams); install transformer-engine, or take the padded layout")
    return problems + packed_cp_problems(f"{section}.{OVERRIDES_KEY}", cp_comm_type, cp=cp)


def default_sequence_layout(*, section: str, cp: int, cp_comm_type, on_cuda: bool,
                            transformer_engine_layers: bool) -> Layout:
    """Packed where transformer-engine's attention takes it (`sequence_layout_problems`), else padded.
    Never packed without transformer-engine: megarl's CPU reference attention materialises the scores
    of a whole packed micro-batch, and megatron's local attention takes padded sequences itself."""
    if transformer_engine_layers and not sequence_layout_problems(
            "packed", section=section, cp=cp, cp_comm_type=cp_comm_type, on_cuda=on_cuda,
            transformer_engine_layers=True):
        return "packed"
    return "padded"


def length_multiple(tp: int, sequence_parallel: bool, cp: int = 1) -> int:
    """What a micro-batch's sequence length (padded layout) or, packed, each sequence's length
    (with CP) or the token count (without) must be a multiple of. With context parallelism, 2 CP
    (`context_parallel.positions_of_rank`: 2 CP equal chunks). With sequence parallelism, each CP
    rank's S / CP positions split evenly over the TP ranks (megatron splits the embeddings' output
    along the sequence, tensor_parallel/mappings.py `_split_along_first_dim`: "First dimension of
    the tensor should be divisible by tensor parallel size"), so S a multiple of CP x TP too."""
    multiple = 2 * cp if cp > 1 else 1
    return math.lcm(multiple, cp * tp) if sequence_parallel else multiple


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def thd_filler(cu_seqlens: Sequence[int], cu_seqlens_padded: Sequence[int], cp: int, multiple: int) -> int:
    """Tokens the filler sequence after packed sequences must have at least, so that
    transformer-engine's CP attention reads their padded offsets: `multiple` (`length_multiple`, a
    multiple of 2 CP) when the last sequence ends in padding, else 0; 0 without CP (transformer-engine
    then gets no `cu_seqlens_padded`). `cu_seqlens` [n + 1]: cumulative real tokens of the n
    sequences; `cu_seqlens_padded` [n + 1]: where each starts, padding counted."""
    # transformer-engine 2.11, pytorch/attention/dot_product_attention/dot_product_attention.py,
    # DotProductAttention.forward ("check if there is padding between sequences"): pad_between_seqs =
    # not torch.equal(cu_seqlens_q_padded[:-1], cu_seqlens_q[:-1]) (or the same for kv), blind to the
    # last sequence's padding. When False, its p2p CP attention (context_parallel.py
    # cp_p2p_fwd_prepare_qkv) cuts each rank's sequences at cu_seqlens_q // cp_size, not at the padded
    # offsets (get_cu_seqlens_on_cp_rank): right only when no sequence has padding. A filler sequence
    # puts the last sequence's padding between sequences. megatron-core 0.16.1 cannot pass
    # pad_between_seqs (0.19 can: PackedSeqParams.pad_between_seqs, extensions/transformer_engine.py);
    # transformer-engine >= 2.18 sets it whenever cu_seqlens_*_padded are not the very cu_seqlens_*
    # tensors (megarl's never are), so the filler suits every version.
    if cp == 1 or len(cu_seqlens) < 2:
        return 0
    real = int(cu_seqlens[-1]) - int(cu_seqlens[-2])
    padded = int(cu_seqlens_padded[-1]) - int(cu_seqlens_padded[-2])
    return multiple if padded > real else 0


def packed_length(lengths: Sequence[int], multiple: int, cp: int) -> int:
    """Tokens of a packed micro-batch of sequences of `lengths` real tokens: with CP each sequence
    padded to `multiple` (a multiple of 2 CP, `length_multiple`), then the filler a padded last
    sequence needs (`thd_filler`); without CP only the total, rounded up to `multiple`."""
    if cp > 1:
        padded = [_round_up(n, multiple) for n in lengths]
        return sum(padded) + thd_filler([0, *accumulate(lengths)], [0, *accumulate(padded)], cp, multiple)
    return _round_up(sum(lengths), multiple)


def fixed_shape(batch: Batch, groups: Sequence[Sequence[int]], layout: Layout, multiple: int = 1,
                cp: int = 1) -> tuple[int, int]:
    """(sequences, tokens) that fit every micro-batch of `groups`: padded layout, the most samples
    of a group and the longest sequence rounded up to a multiple of `multiple` (`length_multiple`);
    packed layout, 1 and the most tokens of a group (`packed_length`)."""
    lengths = batch.token_lengths().tolist()
    if layout == "packed":
        return 1, max(packed_length([lengths[i] for i in g], multiple, cp) for g in groups)
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
    Without it the sequence length (padded) or token count (packed, `packed_length`) is rounded up
    to a multiple of `multiple` (`length_multiple`) the same way; packed with CP, a last sequence
    that ends in padding is always followed by a filler (`thd_filler`). `with_routes`: the batch's
    routed experts laid out for megatron's routers (routing replay). `cp` > 1: the part of CP rank
    `cp_rank` (see `MicroBatch` and `context_parallel`)."""
    index = torch.as_tensor(list(rows), dtype=torch.long)
    part = batch.select(index)
    packed = pack(part, pad_to_multiple_of=multiple if layout == "packed" and cp > 1 else 1)  # one run each
    lengths = packed.prompt_lens + packed.response_lens
    if bool(((packed.response_lens > 0) & (packed.prompt_lens == 0)).any()):
        row = int(((packed.response_lens > 0) & (packed.prompt_lens == 0)).nonzero()[0])
        raise ValueError(f"sample {int(index[row])} has no prompt token: its first response token has no context")
    real = _real_rows(packed, lengths)
    real_ids, position_of_token = packed.input_ids[real], packed.position_ids[real]  # sample 0's first
    bad = (real_ids < 0) | (real_ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(f"token id {int(real_ids[bad][0])} is outside the model's vocabulary of {vocab_size} tokens")
    response_mask = part["response_mask"].bool()
    b, width = response_mask.shape
    cols = torch.arange(width)
    predict_at = packed.prompt_lens[:, None] - 1 + cols[None, :]  # [b, R] sequence position predicting each token
    sample_of_token = torch.repeat_interleave(torch.arange(b), lengths)  # real tokens, sample 0's first
    routed = position_of_token < lengths[sample_of_token] - 1  # all but each sample's last token
    sequence_starts = None
    if layout == "padded":
        sequences, longest = shape or (b, _round_up(int(lengths.max()), multiple))
        input_ids = torch.zeros(sequences, longest, dtype=torch.long)
        input_ids[sample_of_token, position_of_token] = real_ids
        position_ids = torch.arange(longest).expand(sequences, -1).contiguous()
        flat = predict_at * sequences + torch.arange(b)[:, None]  # hidden states are [S, sequences, H]
        packed_seq_params = None
        token_rows = position_of_token * sequences + sample_of_token
        total_rows = longest * sequences
        columns = [positions_of_rank(longest, cp, r) for r in range(cp)]  # each CP rank's positions
        held = None if cp == 1 else [(c[:, None] * sequences + torch.arange(sequences)[None, :]).reshape(-1)
                                     for c in columns]
    elif layout == "packed":
        from megatron.core.packed_seq_params import PackedSeqParams

        total = packed_length(lengths.tolist(), multiple, cp) if shape is None else shape[1]
        filler = total - packed.num_tokens
        needed = thd_filler(packed.cu_seqlens, packed.cu_seqlens_padded, cp, multiple)
        if filler < needed or (cp > 1 and filler % multiple):
            raise ValueError(f"a packed micro-batch of {packed.num_tokens} tokens and a filler of at least {needed} "
                             f"does not fit the shape of {total}")
        input_ids = torch.cat([packed.input_ids, torch.zeros(filler, dtype=torch.long)])[None, :]
        position_ids = torch.cat([packed.position_ids, torch.arange(filler)])[None, :]
        sequence_starts = packed.cu_seqlens_padded[:-1].long()
        flat = sequence_starts[:, None] + predict_at
        cu, cu_padded = packed.cu_seqlens, packed.cu_seqlens_padded
        if filler:  # the filler: one more sequence of `filler` tokens, never scored
            cu, cu_padded = (torch.cat([c, c[-1:] + filler]) for c in (cu, cu_padded))
        longest = max(packed.max_seqlen, filler)
        padded_cu = {} if cp == 1 else {"cu_seqlens_q_padded": cu_padded.to(device),
                                        "cu_seqlens_kv_padded": cu_padded.to(device)}
        packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
            max_seqlen_q=longest, max_seqlen_kv=longest, **padded_cu,
        )
        token_rows = sequence_starts[sample_of_token] + position_of_token
        total_rows = total
        held = None if cp == 1 else [thd_positions_of_rank(cu_padded, cp, r) for r in range(cp)]
    else:
        raise ValueError(f"unknown sequence layout {layout!r}; choose 'padded' or 'packed'")
    targets = part["response_ids"][response_mask].long()
    flat = flat[response_mask]
    cp_tokens = None
    if cp > 1:
        mine = columns[cp_rank] if layout == "padded" else held[cp_rank]  # packed: rows are positions
        input_ids, position_ids = input_ids[:, mine], position_ids[:, mine]
        cp_tokens, flat = split_tokens(flat, held, cp_rank)
        targets = targets[cp_tokens.slots[cp_rank]]
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
        routes=micro_batch_routes(part, token_rows, total_rows) if with_routes else None,
        routed_rows=token_rows[routed].to(device),
        cp=cp_tokens,
        cp_rows=None if held is None else tuple(h.to(device) for h in held),
        sequence_starts=sequence_starts,
    )


def _real_rows(packed, lengths: torch.Tensor) -> torch.Tensor:
    """[T] bool: the rows of packed sequences of `lengths` real tokens that hold a real token (not the
    padding after each sequence)."""
    padded = packed.cu_seqlens_padded.long()
    sample_of_row = torch.repeat_interleave(torch.arange(len(padded) - 1), padded[1:] - padded[:-1])
    return packed.position_ids < lengths[sample_of_row]

