"""Generation ahead of training (`async_training.mode` one_step_off and fully_async): the producer
thread and its buffer, which megarl.trainer.producers' producer of each of the two modes drives.

A producer thread generates rollouts (one step's batch of prompts each, with the prompts, uid
prefix and seeds the synchronous loop would give that step) into a buffer while the controller
trains; the controller takes the oldest one at the start of each step. Versions count actor
updates: the servers hold version v after v steps, and a rollout records the version that
generated it. Staleness of a rollout trained at version v: v minus its version.

- The gate: rollout j (the j-th taken, i.e. step j's) starts only while j - version <= K
  (`max_staleness`; one_step_off: K = 1), so no rollout is ever trained more than K versions late.
- The push lands between generations: `pause()` stops new starts and waits for the one running
  (one_step_off: also until every rollout the gate allows at this version has run, so rollout
  j+1 is always generated with the weights of step j, whatever the timings). The producer stays
  paused until the next `take()`, so a checkpoint written in between sees no generation running:
  the buffer (token ids, rollout log-probs, versions) and the sampler saved with it are the
  whole state, and a resumed run trains on exactly those batches.
- A rollout past the bound (possible only after resuming with a smaller K) is dropped and
  counted, or generated again with the current weights (`stale_samples`).
- Exact resume, fully_async: which version generates a rollout not yet started at the checkpoint
  depends on timing (and, with partial rollouts, where a push cuts it), in an uninterrupted run
  as much as in a resumed one; so what is exact by design is the checkpoint's part: every rollout
  generated and not yet trained (tokens, rollout log-probs, versions, per-token versions) is
  trained as the uninterrupted run trains it, and the later ones take the same prompts, uids and
  seeds. With the schedule pinned (`fill_window`: rollout j from version max(0, j - K), as when
  generation outpaces training) whole resumed runs equal uninterrupted ones (test_async_e2e.py).

- A server that dies mid-generation is not restarted by the producer (a restart re-pushes the
  actor's weights, which the controller may be updating): the generation raises
  `RolloutInterrupted` with its answers so far and the producer parks. The controller restarts
  the dead servers where nothing else runs: at the push (`pause()` returns at once when the
  producer is parked, and the push restarts dead servers first) or in `take()` (the `recover`
  callback, between the push and training). The parked rollout then resumes: its lost prompts
  are sent again with their seeds, the answers it had are kept, so every prompt is trained once.
  Its `version` stays that of its first part (the oldest weights in it: the staleness bound holds).

- Partial rollouts (fully_async with `partial_rollout`): `pause(interrupt=True)` stops new
  starts only; the controller aborts the running generation at the servers, pushes, and lets it
  continue with the new weights (its samples then carry per-token `weight_versions`; the
  rollout's `version` stays the one it started with). A checkpoint waits for it to finish. A
  server that dies inside that pause is restarted by the push, paused too, and the requests lost
  with it are sent again from their tokens (from scratch past the client's retries, counted) and
  wait there for the pushed weights (megarl.runtime.rollout_fleet).

Metrics per step: `async/staleness_mean`, `async/staleness_max` (versions, per sample),
`async/dropped_samples`, `async/buffered_rollouts`, and `timing/generate_hidden_s`: seconds of
the taken rollout's generation that ran while the controller did something else.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from megarl.rollout.client import Sample


@dataclass
class Rollout:
    """One step's generation: `samples[i]` are the responses to dataset prompt `prompt_indices[i]`,
    generated with weight `version` (actor updates), uids `<uid_prefix>-<prompt index>`."""

    index: int  # the j-th rollout produced (step j's, unless one was dropped)
    uid_prefix: str
    prompt_indices: list[int]
    samples: list[list[Sample]]
    version: int
    metrics: dict[str, float] = field(default_factory=dict)  # the rollout's own (rollout/*)
    generate_s: float = 0.0  # wall seconds the generation took
    waited_s: float = 0.0  # of them, seconds the controller spent blocked on it

    @property
    def num_samples(self) -> int:
        return sum(len(s) for s in self.samples)

    def state_dict(self) -> dict:
        """Plain containers only (checkpoints load with `weights_only`)."""
        return {"index": self.index, "uid_prefix": self.uid_prefix, "prompt_indices": list(self.prompt_indices),
                "version": self.version, "metrics": dict(self.metrics), "generate_s": self.generate_s,
                "waited_s": self.waited_s,
                "samples": [[_sample_state(s) for s in per_prompt] for per_prompt in self.samples]}

    @classmethod
    def from_state(cls, state: dict) -> Rollout:
        samples = [[Sample(**s) for s in per_prompt] for per_prompt in state["samples"]]
        return cls(state["index"], state["uid_prefix"], list(state["prompt_indices"]), samples, state["version"],
                   dict(state["metrics"]), state["generate_s"], state["waited_s"])


def _sample_state(s: Sample) -> dict:
    return {"token_ids": list(s.token_ids), "logprobs": None if s.logprobs is None else list(s.logprobs),
            "finish_reason": s.finish_reason, "matched": s.matched, "text": s.text,
            "weight_version": s.weight_version,
            "weight_versions": None if s.weight_versions is None else list(s.weight_versions)}


class RolloutInterrupted(Exception):
    """Raised by a `GenerateFn` whose servers died mid-generation: `prompt_indices` (the rollout's
    prompts) and `partial` (its answers so far) are passed back to finish it after a restart."""

    def __init__(self, prompt_indices: list[int], partial):
        super().__init__(f"rollout of prompts {prompt_indices} interrupted by a dead rollout server")
        self.prompt_indices, self.partial = prompt_indices, partial


# generate(index, version, prompt_indices or None: the sampler's next batch, partial=None) -> Rollout;
# `partial`: a `RolloutInterrupted.partial` to finish
GenerateFn = Callable[..., Rollout]


class RolloutProducer:
    """The buffer and the thread that fills it (see the module docstring)."""

    def __init__(self, generate: GenerateFn, *, max_staleness: int, stale_samples: str = "drop",
                 fill_window: bool = False, version: int = 0, limit: int, wait_timeout_s: float = 3600.0,
                 recover: Callable[[], int] = lambda: 0):
        """`limit`: rollouts never go past this index (the run's total steps); `version`: the
        servers' weight version now; `fill_window`: `pause()` waits until every rollout the gate
        allows has run (one_step_off's fixed schedule); `recover()`: restarts dead servers (with
        the current weights), called by `take()` on the controller's thread while parked."""
        self._generate, self._recover = generate, recover
        self.max_staleness, self.stale_samples, self.fill_window = max_staleness, stale_samples, fill_window
        self.version, self.limit, self.wait_timeout_s = version, limit, wait_timeout_s
        self.next_index = version  # the next rollout to produce (rollout j for step j)
        self.ready: deque[Rollout] = deque()
        self._extra = 0  # rollouts added to `limit` for dropped ones
        self._cond = threading.Condition()
        self._paused, self._busy, self._stopped = True, False, False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._counts = {"dropped_samples": 0, "regenerated_samples": 0}
        # (index, version, RolloutInterrupted) of a generation a dead server cut short;
        # `_parked`: it waits for the controller to restart the servers
        self._interrupted: Optional[tuple[int, int, RolloutInterrupted]] = None
        self._parked = False

    # ---------------------------------------------------------------- the producer thread
    def _may_start(self) -> bool:
        return (not self._paused and not self._parked and self.next_index < self.limit
                and self.next_index - self.version <= self.max_staleness)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._may_start())
                if self._stopped:
                    return
                index, version, self._busy = self.next_index, self.version, True
                interrupted, self._interrupted = self._interrupted, None
            try:
                if interrupted is None:
                    rollout = self._generate(index, version, None)
                else:  # finish it with the servers' current weights; it keeps its first version
                    index, first_version, cut = interrupted
                    rollout = self._generate(index, version, cut.prompt_indices, cut.partial)
                    rollout.version = version = first_version
            except RolloutInterrupted as cut:
                with self._cond:
                    self._interrupted, self._parked, self._busy = (index, version, cut), True, False
                    self._cond.notify_all()
                continue
            except BaseException as error:  # handed to the controller at its next take/pause
                with self._cond:
                    self._error, self._busy = error, False
                    self._cond.notify_all()
                return
            with self._cond:
                self.ready.append(rollout)
                self.next_index += 1
                self._busy = False
                self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool], what: str) -> float:
        """Block (lock held) until `ready()`; returns the seconds waited. Raises the producer's error."""
        start = time.perf_counter()
        if not self._cond.wait_for(lambda: self._error is not None or ready(), timeout=self.wait_timeout_s):
            raise TimeoutError(f"no {what} within {self.wait_timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"the rollout producer failed: {self._error}") from self._error
        return time.perf_counter() - start

    # ---------------------------------------------------------------- the controller's side
    def take(self) -> tuple[Rollout, dict[str, float]]:
        """The next rollout to train on (blocking until it is generated) and the async metrics;
        lets the producer run. A rollout more than `max_staleness` versions old is dropped (and
        the next one taken) or generated again now, with the same prompts and seeds."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
            self._thread.start()
        with self._cond:
            self._paused = False
            self._cond.notify_all()
            while True:
                waited = self._wait(lambda: bool(self.ready) or self._parked, "rollout")
                if self._parked:  # the producer waits; the controller is not training: restart here
                    self._recover()
                    self._parked = False
                    self._cond.notify_all()
                    if not self.ready:
                        continue
                rollout = self.ready.popleft()
                rollout.waited_s += waited
                if self.version - rollout.version <= self.max_staleness:
                    break
                if self.stale_samples == "regenerate":
                    self._counts["regenerated_samples"] += rollout.num_samples
                    self._paused = True  # the servers serve this one alone
                    self._wait(lambda: not self._busy, "idle producer")
                    start = time.perf_counter()
                    try:
                        fresh = self._generate(rollout.index, self.version, rollout.prompt_indices)
                    except RolloutInterrupted as cut:  # on this thread, not training: restart, finish it
                        self._recover()
                        fresh = self._generate(rollout.index, self.version, cut.prompt_indices, cut.partial)
                    fresh.waited_s = time.perf_counter() - start
                    self._paused = False
                    self._cond.notify_all()
                    rollout = fresh
                    break
                self._counts["dropped_samples"] += rollout.num_samples
                self.limit += 1  # the dropped step's batch comes from one more rollout
                self._extra += 1
        staleness = self.version - rollout.version
        metrics = {
            "async/staleness_mean": float(staleness),  # every sample of a rollout shares its version
            "async/staleness_max": float(staleness),
            "async/rollout_version": float(rollout.version),
            "async/buffered_rollouts": float(len(self.ready)),
            **{f"async/{k}": float(v) for k, v in self._counts.items()},
            "timing/generate_hidden_s": max(0.0, rollout.generate_s - rollout.waited_s),
            "timing/generate_wait_s": rollout.waited_s,
        }
        self._counts = dict.fromkeys(self._counts, 0)
        return rollout, metrics

    def pause(self, interrupt: bool = False) -> float:
        """Before a weight push: no new generation starts, the running one finishes (with
        `fill_window`, every one the gate allows at this version runs first; with `interrupt`,
        partial rollouts, it runs on across the push). Returns the seconds waited, counted as
        waited on the newest rollout."""
        with self._cond:
            waited = 0.0
            if self.fill_window and self._thread is not None:
                waited += self._wait(lambda: not self._busy and not self._may_start(), "rollout window")
            self._paused = True
            if not interrupt:
                waited += self._wait(lambda: not self._busy, "running rollout")
            if self.ready:
                self.ready[-1].waited_s += waited
            return waited

    def pushed(self, version: int) -> None:
        """The servers now hold `version`; the producer stays paused until the next `take()`."""
        with self._cond:
            self.version = version

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.wait_timeout_s)

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """Call while paused (between a push and the next take); a generation still running (partial
        rollouts) is waited for, so the state holds it whole."""
        with self._cond:
            self._wait(lambda: not self._busy, "running rollout")
            # an interrupted rollout is saved as its prompts: a resumed run generates it whole
            interrupted = None if self._interrupted is None else {
                "index": self._interrupted[0], "version": self._interrupted[1],
                "prompt_indices": list(self._interrupted[2].prompt_indices)}
            return {"next_index": self.next_index, "extra": self._extra,
                    "ready": [r.state_dict() for r in self.ready], "interrupted": interrupted}

    def load_state_dict(self, state: dict) -> None:
        with self._cond:
            self.next_index = state["next_index"]
            self.limit += state["extra"] - self._extra
            self._extra = state["extra"]
            self.ready = deque(Rollout.from_state(r) for r in state["ready"])
            cut = state.get("interrupted")
            self._interrupted = None if cut is None else (
                cut["index"], cut["version"], RolloutInterrupted(list(cut["prompt_indices"]), None))
            self._parked = False
