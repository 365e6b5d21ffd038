"""Deterministic, resumable batch sampling over a dataset's indices. No torch here.

Epoch e visits a permutation drawn from (seed, e) alone, so the batches a run sees depend only
on (seed, dataset size, batch size), and a sampler restored from `state_dict()` continues with
exactly the batches the uninterrupted run would have drawn.
"""
from __future__ import annotations

import numpy as np

from megarl.data.errors import DataError


class EpochSampler:
    """Batches of dataset indices, epoch after epoch.

    drop_last (training): every batch has exactly `batch_size` indices and an epoch's remainder
    is skipped; otherwise the epoch's last batch may be short (validation).
    """

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 1, drop_last: bool = True):
        if batch_size < 1:
            raise DataError(f"batch size must be at least 1, got {batch_size}")
        if num_samples < (batch_size if drop_last else 1):
            raise DataError(f"the dataset has {num_samples} prompts, fewer than one batch of {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.position = 0  # indices of the current epoch's order already handed out
        self._order = self._epoch_order(0)

    @classmethod
    def from_config(cls, data_config, num_samples: int, split: str = "train") -> "EpochSampler":
        """Training: data.gen_batch_size (default data.train_batch_size) prompts per batch,
        shuffled by data.shuffle and data.seed, remainder dropped. Validation: data.val_batch_size
        (None: all) in file order."""
        if split == "train":
            batch = data_config.prompts_per_generation
            if num_samples < batch:
                key = "data.gen_batch_size" if data_config.gen_batch_size else "data.train_batch_size"
                raise DataError(f"data.train_files hold {num_samples} usable prompts, fewer than one batch "
                                f"({key}={batch})")
            return cls(num_samples, batch, shuffle=data_config.shuffle, seed=data_config.seed)
        return cls(num_samples, data_config.val_batch_size or num_samples, shuffle=False, drop_last=False)

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def _epoch_end(self) -> int:
        return self.batches_per_epoch * self.batch_size if self.drop_last else self.num_samples

    def next_batch(self) -> list[int]:
        """The next batch of indices, starting the next epoch when this one is used up."""
        if self.position >= self._epoch_end():
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        batch = self._order[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch.tolist()

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`. The dataset size, batch size and shuffling must be the ones
        the state was saved with, or the batches would differ: that raises DataError."""
        for key in ("num_samples", "batch_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data sampler: saved {key}={state[key]}, this run has {getattr(self, key)} "
                    "(same data files, length limits and batch size are needed to resume)"
                )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)
