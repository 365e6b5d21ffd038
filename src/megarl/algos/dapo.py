"""DAPO's extras (Yu et al. 2025): dynamic sampling (keep only groups that carry a learning signal)
and the soft overlong penalty.

Dynamic sampling, as the loop uses it:

    sampler = DynamicSampler(target_groups=data.train_batch_size, max_rounds=max_num_gen_batches)
    while not sampler.is_full:
        batch = generate_and_score(next_prompts)          # responses of whole groups
        keep = sampler.add(batch.uids, batch.metric)      # indices into this batch
        kept.append(batch.select(keep))
"""
from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import torch


class GroupFilterResult(NamedTuple):
    keep_indices: list[int]  # responses of the informative groups, in batch order
    kept_groups: list[Hashable]  # their uids, in order of first appearance
    num_groups: int


def filter_informative_groups(uids: Sequence[Hashable], metric_values: Sequence[float]) -> GroupFilterResult:
    """Drop every group whose metric values are all equal (a group of one response included):
    such a group has zero advantage under GRPO-style estimators and only dilutes the batch."""
    if len(uids) != len(metric_values):
        raise ValueError(f"uids has {len(uids)} entries but metric_values has {len(metric_values)}")
    members: dict[Hashable, list[int]] = {}
    for i, uid in enumerate(uids):
        members.setdefault(uid, []).append(i)
    values = [float(v) for v in metric_values]
    kept = [uid for uid, idx in members.items() if len(idx) > 1 and len({values[i] for i in idx}) > 1]
    kept_set = set(kept)
    keep = [i for i, uid in enumerate(uids) if uid in kept_set]
    return GroupFilterResult(keep, kept, len(members))


class DynamicSamplingExhausted(RuntimeError):
    """More generation rounds than allowed were needed to fill the batch."""


class DynamicSampler:
    """Accumulates informative groups over generation rounds until `target_groups` are kept.

    `max_rounds` caps the rounds (0: no cap); reaching it without a full batch raises
    DynamicSamplingExhausted, naming how far it got (as verl does: the data are likely too hard or
    too easy for the model).
    """

    def __init__(self, target_groups: int, max_rounds: int = 0):
        if target_groups <= 0:
            raise ValueError(f"target_groups={target_groups} must be > 0")
        if max_rounds < 0:
            raise ValueError(f"max_rounds={max_rounds} must be >= 0 (0: no cap)")
        self.target_groups = target_groups
        self.max_rounds = max_rounds
        self.rounds = 0
        self.kept_groups = 0
        self.seen_groups = 0

    @property
    def is_full(self) -> bool:
        return self.kept_groups >= self.target_groups

    def add(self, uids: Sequence[Hashable], metric_values: Sequence[float]) -> list[int]:
        """Indices (into this round's batch) of the responses to keep: whole informative groups, no
        more groups than the batch still needs."""
        if self.is_full:
            raise RuntimeError("DynamicSampler.add called on a full batch")
        self.rounds += 1
        result = filter_informative_groups(uids, metric_values)
        self.seen_groups += result.num_groups
        wanted = set(result.kept_groups[: self.target_groups - self.kept_groups])
        self.kept_groups += len(wanted)
        if not self.is_full and self.max_rounds and self.rounds >= self.max_rounds:
            raise DynamicSamplingExhausted(
                f"dynamic sampling kept {self.kept_groups} of the {self.target_groups} groups needed after "
                f"{self.rounds} generation rounds (algorithm.filter_groups.max_num_gen_batches={self.max_rounds}); "
                f"{self.seen_groups} groups were seen and the rest had all-equal rewards: the prompts may be "
                f"too easy or too hard for the model; raise the cap or set it to 0 (no cap)"
            )
        return [i for i in result.keep_indices if uids[i] in wanted]

    def metrics(self) -> dict[str, float]:
        """kept_ratio: kept groups / groups generated so far; rounds: generation rounds used."""
        return {
            "kept_ratio": self.kept_groups / self.seen_groups if self.seen_groups else 0.0,
            "num_gen_rounds": float(self.rounds),
            "kept_groups": float(self.kept_groups),
        }


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, to add to each response's score. `[batch]` lengths (tokens)
    -> `[batch]` float32 penalties <= 0:

        0                                             if L <= max_response_length - buffer_len
        -(L - (max_response_length - buffer_len)) / buffer_len * penalty_factor   otherwise

    so a response of exactly max_response_length tokens gets -penalty_factor. buffer_len 0: no penalty.
    """
    if buffer_len < 0 or buffer_len > max_response_length:
        raise ValueError(f"overlong buffer_len={buffer_len} must be in [0, max_response_length={max_response_length}]")
    lengths = response_lengths.to(torch.float32)
    if buffer_len == 0:
        return torch.zeros_like(lengths)
    excess = lengths - (max_response_length - buffer_len)
    return torch.clamp(-excess / buffer_len * penalty_factor, max=0.0)
