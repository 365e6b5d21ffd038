"""The per-row state of the sequences the CPU engine decodes together (`engine.CPUEngine`).

Row r of every tensor belongs to `seqs[r]`. The rows share one KV cache of `length` filled columns,
aligned on the right: row r's first `pad[r]` columns are left padding (masked out), the others its
prompt and the tokens fed back so far. `keep` drops finished rows; `extend` appends rows prefilled
on their own (newcomers joining a running batch), padding the shorter side on the left so that
both end at the same column, as `kv_cache.append_rows` lays out their keys and values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def stop_table(seqs: list, eos_token_ids: frozenset[int]) -> Optional[torch.Tensor]:
    """[B, S] stop ids per row (stop_token_ids and EOS; none with ignore_eos), padded with -1; None if empty."""
    rows = [[] if s.sampling.ignore_eos else sorted({*s.sampling.stop_token_ids, *eos_token_ids}) for s in seqs]
    width = max(len(r) for r in rows)
    if width == 0:
        return None
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows])


def _stack_columns(a: torch.Tensor, b: torch.Tensor, value: float = 0) -> torch.Tensor:
    """[rows_a + rows_b, max width]: `a` above `b`, the narrower filled on the right with `value`."""
    width = max(a.shape[1], b.shape[1])
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in (a, b)])


def _stack_stop_ids(a: Optional[torch.Tensor], rows_a: int, b: Optional[torch.Tensor], rows_b: int):
    """Two stop tables ([rows, S] or None: no stop ids) as one, -1 where a row has fewer."""
    if a is None and b is None:
        return None
    a = torch.full((rows_a, 0), -1) if a is None else a
    b = torch.full((rows_b, 0), -1) if b is None else b
    return _stack_columns(a, b, value=-1)


@dataclass(eq=False)
class DecodeRows:
    """Sampling settings, positions and outputs of B rows; tensors are [B] unless said."""

    seqs: list  # the `engine.Sequence` of each row
    length: int  # filled KV-cache columns, the same for every row
    pad: torch.Tensor  # long: left-padding columns of each row
    next_pos: torch.Tensor  # [B, 1] long: the position id of each row's next input token
    counts: torch.Tensor  # long: tokens sampled so far
    max_new: torch.Tensor  # long: max_new_tokens
    temperatures: torch.Tensor  # float32, 0 = greedy
    top_ps: torch.Tensor  # float32
    top_ks: torch.Tensor  # long, vocabulary size = off
    stop_ids: Optional[torch.Tensor]  # [B, S] (`stop_table`)
    generators: dict[int, torch.Generator]  # rows with their own `sampling_seed`
    string_rows: list[int]  # rows with stop strings
    top_rows: list[int]  # rows asking for their tokens' top log-probs (top_logprobs_num > 0)
    out_ids: torch.Tensor  # [B, T] long, T = the largest max_new_tokens
    out_logprobs: torch.Tensor  # [B, T] float32

    @classmethod
    def for_prompts(cls, seqs: list, vocab_size: int, eos_token_ids: frozenset[int]) -> DecodeRows:
        """Rows for prompts left-padded to the longest, before their prefill."""
        lengths = torch.tensor([len(s.prompt_ids) for s in seqs])
        width = int(lengths.max())
        max_new = torch.tensor([s.sampling.max_new_tokens for s in seqs])
        return cls(
            seqs=list(seqs),
            length=width,
            pad=width - lengths,
            next_pos=lengths[:, None].clone(),
            counts=torch.zeros(len(seqs), dtype=torch.long),
            max_new=max_new,
            temperatures=torch.tensor([float(s.sampling.temperature) for s in seqs]),
            top_ps=torch.tensor([float(s.sampling.top_p) for s in seqs]),
            top_ks=torch.tensor([s.sampling.top_k if s.sampling.top_k_enabled else vocab_size for s in seqs]),
            stop_ids=stop_table(seqs, eos_token_ids),
            generators={r: torch.Generator().manual_seed(s.seed) for r, s in enumerate(seqs) if s.seed is not None},
            string_rows=[r for r, s in enumerate(seqs) if s.sampling.stop],
            top_rows=[r for r, s in enumerate(seqs) if s.top_logprobs_num > 0],
            out_ids=torch.empty(len(seqs), int(max_new.max()), dtype=torch.long),
            out_logprobs=torch.empty(len(seqs), int(max_new.max())),
        )

    def __len__(self) -> int:
        return len(self.seqs)

    def prompt_ids(self) -> torch.Tensor:
        """[B, length] the prompts left-padded with 0 (the prefill's input)."""
        return torch.tensor([[0] * pad + seq.prompt_ids for pad, seq in zip(self.pad.tolist(), self.seqs)],
                            dtype=torch.long)

    def attention_mask(self, columns: int) -> torch.Tensor:
        """[B, columns] long: 0 in each row's left padding, 1 elsewhere."""
        return (torch.arange(columns)[None, :] >= self.pad[:, None]).long()

    def remaining(self) -> int:
        """The most tokens any row may still sample."""
        return int((self.max_new - self.counts).max())

    def record(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Store one sampled token and its log-prob per row."""
        rows = torch.arange(len(self))
        self.out_ids[rows, self.counts] = tokens
        self.out_logprobs[rows, self.counts] = logprobs
        self.counts += 1

    def record_top_logprobs(self, logits: torch.Tensor) -> None:
        """Append to each of `top_rows`' sequences the k = top_logprobs_num most likely tokens of the
        distribution its token was just sampled from, as (logprob, id) descending: the log-probs the
        sampled token's are (`engine.sample_tokens`: log_softmax(logits / T), T = 1 when greedy), as
        SGLang 0.5.23 takes the top k of the sampler's own log-probs (`layers/sampler.py::Sampler.forward`
        `output_logprob_processor.compute_logprobs(logprobs, top_logprobs_nums, ...)`). `logits`: [B, V]."""
        for row in self.top_rows:
            seq, temperature = self.seqs[row], float(self.temperatures[row])
            logp = torch.log_softmax(logits[row] / (temperature if temperature > 0 else 1.0), dim=-1)
            values, ids = logp.topk(seq.top_logprobs_num)
            seq.output_top_logprobs.append(list(zip(values.tolist(), ids.tolist())))

    def fed(self) -> None:
        """One token per row went through the model: one more cache column, next positions."""
        self.length += 1
        self.next_pos += 1

    def token_ids(self, row: int, drop_last: bool = False) -> list[int]:
        """The tokens row `row` sampled so far, without the last with `drop_last`."""
        return self.out_ids[row, : int(self.counts[row]) - int(drop_last)].tolist()

    def outputs(self, rows: list[int], drop_last: set[int]) -> list[tuple[list[int], list[float]]]:
        """(tokens, their log-probs) sampled so far by each of `rows`, those in `drop_last`
        without their last: `token_ids` for several rows, one conversion to lists for all."""
        index = torch.tensor(rows, dtype=torch.long)
        ids, logprobs = self.out_ids[index].tolist(), self.out_logprobs[index].tolist()
        ends = [count - (row in drop_last) for row, count in zip(rows, self.counts[index].tolist())]
        return [(i[:end], lp[:end]) for i, lp, end in zip(ids, logprobs, ends)]

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows`, in that order (the KV cache must keep the same ones)."""
        index = torch.tensor(rows)
        new_row = {old: new for new, old in enumerate(rows)}
        self.seqs = [self.seqs[r] for r in rows]
        for name in ("pad", "next_pos", "counts", "max_new", "temperatures", "top_ps", "top_ks",
                     "out_ids", "out_logprobs"):
            setattr(self, name, getattr(self, name)[index])
        if self.stop_ids is not None:
            self.stop_ids = self.stop_ids[index]
        self.generators = {new_row[r]: g for r, g in self.generators.items() if r in new_row}
        self.string_rows = [new_row[r] for r in self.string_rows if r in new_row]
        self.top_rows = [new_row[r] for r in self.top_rows if r in new_row]

    def extend(self, other: DecodeRows) -> None:
        """Append `other`'s rows after this batch's; the shorter side gains left padding so that both
        end at column max(length, other.length)."""
        length = max(self.length, other.length)
        offset = len(self)
        self.stop_ids = _stack_stop_ids(self.stop_ids, len(self), other.stop_ids, len(other))
        self.pad = torch.cat([self.pad + (length - self.length), other.pad + (length - other.length)])
        for name in ("next_pos", "counts", "max_new", "temperatures", "top_ps", "top_ks"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.out_ids = _stack_columns(self.out_ids, other.out_ids)
        self.out_logprobs = _stack_columns(self.out_logprobs, other.out_logprobs)
        self.generators.update({offset + r: g for r, g in other.generators.items()})
        self.string_rows += [offset + r for r in other.string_rows]
        self.top_rows += [offset + r for r in other.top_rows]
        self.seqs += other.seqs
        self.length = length
