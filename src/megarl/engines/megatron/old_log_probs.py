"""The PPO ratio's old log-probs made inside the actor's update
(`actor_rollout_ref.actor.old_log_probs_in_update`), instead of by a forward pass over the whole
batch that the controller calls before it.

Old log-probs are the policy's log-probs under the weights before the update's first optimizer
step. The first mini-batch's training forward runs under exactly those weights, so its own
log-probs, detached, are its old log-probs (what TRL's GRPOTrainer takes when generation and
optimizer steps line up, and verl's on-policy path did: `log_prob.detach()`); its PPO ratio is
then exactly 1. Only the other rows need a forward pass of their own, run without gradients
before the first optimizer step. This saves the forward over the first mini-batch's rows and the
controller's separate call, and returns the same quantities that pass would (log-probs and
entropies of every row, before the update) for the controller's metrics.

An MoE model's update scores every row in the pass before the first step instead: that pass also
counts the tokens its routers send to each expert (`expert_counts`), which a training forward
does not. With LoRA dropout (`model.lora.dropout` > 0) the first mini-batch's old log-probs are
those of its own forward, dropout included, as in TRL; the other rows' are without dropout.
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl.data.batch import Batch
from megarl.engines.megatron.schedule import Head
from megarl.engines.megatron.sequences import MicroBatch


class OldLogProbsInUpdate:
    """One update's old log-probs and entropies over this rank's samples.

    `batch` (this rank's samples, without "old_log_probs") is copied, not changed: `self.batch`
    holds "old_log_probs" [B, R] float32, filled as the update goes (on last-stage ranks, where
    the loss head reads them; zeros elsewhere). Pass `self.batch` to `train_batch` with
    `before_mini_batch` and call `old_log_probs` in the loss head. `score_head`, `max_samples`,
    `max_tokens`: the log-prob head (with entropy) and micro-batch limits of the pass over the
    other rows."""

    def __init__(self, engine, batch: Batch, score_head: Head, *, max_samples: Optional[int],
                 max_tokens: Optional[int]):
        if "old_log_probs" in batch:
            raise ValueError(f"{engine.section}: the batch already holds old_log_probs; the update makes them "
                             "(actor_rollout_ref.actor.old_log_probs_in_update)")
        self.engine, self.score_head = engine, score_head
        self.max_samples, self.max_tokens = max_samples, max_tokens
        self.batch = Batch(dict(batch.tensors), dict(batch.meta))
        self.batch["old_log_probs"] = torch.zeros(batch["response_mask"].shape, dtype=torch.float32)
        self.log_probs = self.batch["old_log_probs"]  # filled in place: later mini-batches select from it
        self.entropy = torch.zeros_like(self.log_probs)
        self.expert_tokens: Optional[torch.Tensor] = None
        self._first_rows: Optional[torch.Tensor] = None  # rows of `batch` whose own forward is running
        self._own: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, log-probs, entropies) kept

    def before_mini_batch(self, index: int, rows: torch.Tensor) -> None:
        """`train_batch`'s hook: before the first step, score every row but the first mini-batch's
        `rows` that run (all rows for an MoE model; the rows the update leaves out, whose advantages
        are 0, are scored here: the controller's entropy and mismatch metrics read every row); the
        first mini-batch's come from its own forward, kept by `old_log_probs` and written here
        before the next mini-batch is taken."""
        if index > 0:
            self._keep_own()
            return
        own = self.engine.arch.moe is None
        others = torch.ones(len(self.batch), dtype=torch.bool)
        if own:
            others[rows] = False
        others = others.nonzero().flatten()
        if len(others):
            self._score(others)
        self._first_rows = rows if own else None

    def _score(self, rows: torch.Tensor) -> None:
        outputs, self.expert_tokens = self.engine.forward_outputs(
            self.batch.select(rows), self.score_head, max_samples=self.max_samples, max_tokens=self.max_tokens,
            count_experts=True)
        for out in outputs:
            self.log_probs[rows[out["rows"]]] = out["log_probs"].float().cpu()
            self.entropy[rows[out["rows"]]] = out["entropy"].float().cpu()

    def old_log_probs(self, mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """In the loss head: micro-batch `mb`'s old log-probs [b, R], given its log-probs and
        entropies [b, R] from this forward. In the first mini-batch those, detached (and kept, on
        the device until the mini-batch is done: no copy to the host inside the schedule);
        later, the ones made before."""
        if self._first_rows is None:
            return mb.data["old_log_probs"]
        own = log_probs.detach()
        self._own.append((self._first_rows[mb.rows], own, entropy.detach()))
        return own

    def _keep_own(self) -> None:
        """Write the first mini-batch's own log-probs and entropies into the batch's."""
        for rows, log_probs, entropy in self._own:
            self.log_probs[rows] = log_probs.float().cpu()
            self.entropy[rows] = entropy.float().cpu()
        self._own, self._first_rows = [], None

    def outputs(self) -> dict[str, torch.Tensor]:
        """After the update: what `compute_log_prob(batch, temperature, with_entropy=True)` would
        have returned before it: {"log_probs", "entropy"} [B, R] (, "expert_tokens" [L, E] for an
        MoE model)."""
        self._keep_own()
        result = {"log_probs": self.log_probs, "entropy": self.entropy}
        if self.expert_tokens is not None:
            result["expert_tokens"] = self.expert_tokens
        return result
