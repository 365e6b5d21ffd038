"""Training metrics that say how they combine over the micro-batches of a mini-batch.

A loss computed on one micro-batch reports `Metrics`: name -> detached 0-dim tensor, each value
added together with its `Reduction`. The training engine combines every micro-batch of every
data-parallel rank by that reduction into the mini-batch's value (`megarl.engines.megatron.metrics`):

  SUM         a loss aggregated with the mini-batch's global token and sequence counts
              (`agg_loss(num_tokens=, num_seqs=)`): the micro-batch values add up to it
  TOKEN_MEAN  a mean over this micro-batch's valid tokens: averaged weighted by token counts
  MAX, MIN    the largest / smallest value of any micro-batch
  CONSTANT    the same in every micro-batch (a coefficient): reported as it is
"""
from __future__ import annotations

import enum
from typing import Iterator, Mapping

import torch


class Reduction(enum.Enum):
    SUM = "sum"
    TOKEN_MEAN = "token_mean"
    MAX = "max"
    MIN = "min"
    CONSTANT = "constant"


class Metrics(Mapping[str, torch.Tensor]):
    """Read like a dict of 0-dim tensors; written only through `add`, which takes the reduction."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor] = {}
        self._reductions: dict[str, Reduction] = {}

    def add(self, name: str, value: torch.Tensor, reduction: Reduction) -> None:
        if not isinstance(reduction, Reduction):
            raise TypeError(f"metric {name!r}: reduction must be a Reduction, got {reduction!r}")
        self._values[name] = value
        self._reductions[name] = reduction

    def update(self, other: Metrics) -> None:
        """Add every metric of `other`, with its reduction."""
        for name, value in other.items():
            self.add(name, value, other.reduction(name))

    def reduction(self, name: str) -> Reduction:
        return self._reductions[name]

    def cloned(self) -> Metrics:
        """A copy whose values are detached clones (safe from later in-place changes)."""
        copy = Metrics()
        for name, value in self.items():
            copy.add(name, value.detach().clone(), self.reduction(name))
        return copy

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Metrics({', '.join(f'{n}={v!r} ({self._reductions[n].value})' for n, v in self.items())})"
