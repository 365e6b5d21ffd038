"""Where each step's batch comes from: one producer per `async_training.mode`, behind one
interface, so `RLTrainer.train_step` reads the same in every mode:

    batch, metrics = producer.take(timer)          # the step's scored batch
    ... train on it ...
    with producer.push(timer, version):            # around the weight push, what the mode needs
        cluster.push_phase(); cluster.push_weights(); cluster.rollout_phase()

    sync          `SyncProducer`: the step generates and scores its own batch; the push finds the
                  servers idle.
    one_step_off  `OneStepOffProducer`: the batch of step j+1 is generated with the weights of
                  step j while step j trains; the push lands between generations.
    fully_async   `FullyAsyncProducer`: batches are generated whenever the servers are free, at
                  most `max_staleness` versions old; the push lands between generations or, with
                  `partial_rollout`, interrupts the one in flight (pause, push, continue).

The two async modes share the producer thread and its buffer (megarl.trainer.async_rollout); the
trainer gives each producer its generation and scoring as functions, so this module holds only
what differs between the modes.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from megarl.config.schema import AsyncTrainingConfig
from megarl.data.batch import Batch
from megarl.trainer.async_rollout import GenerateFn, Rollout, RolloutProducer
from megarl.runtime.cluster import Cluster
from megarl.runtime.rollout_fleet import RolloutFleet
from megarl.trainer.timing import Timer

Scored = tuple[Batch, dict[str, float]]  # a scored batch and its metrics


class BatchProducer(Protocol):
    def take(self, timer: Timer) -> Scored:
        """The step's scored batch and its metrics (`timing/generate_s`: the time the step
        generated it, or waited for it)."""

    def push(self, timer: Timer, version: int) -> AbstractContextManager[None]:
        """A context around the weight push that makes the servers' weights `version`."""

    def close(self) -> None:
        """Stop generating (the loop ended, however it ended)."""

    def state_dict(self) -> dict:
        """The producer's entries of the controller's checkpoint state ({} if none)."""

    def load_state_dict(self, state: dict, step: int) -> None:
        """Resume from the controller's checkpoint `state` of `step` (the servers hold version `step`)."""


class SyncProducer:
    """sync: `collect(timer)` generates and scores the step's batch (RLTrainer.collect_experience)."""

    def __init__(self, collect: Callable[[Timer], Scored]):
        self.collect = collect

    def take(self, timer: Timer) -> Scored:
        return self.collect(timer)

    @contextmanager
    def push(self, timer: Timer, version: int) -> Iterator[None]:
        yield  # nothing generates during the push

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, step: int) -> None:
        pass


class _AheadProducer:
    """The async modes: `rollouts` generates ahead in its thread; `score(rollout, timer)` makes a
    taken rollout the step's scored batch (RLTrainer.score_rollout)."""

    def __init__(self, rollouts: RolloutProducer, score: Callable[[Rollout, Timer], Scored]):
        self.rollouts, self.score = rollouts, score

    def take(self, timer: Timer) -> Scored:
        with timer("generate"):  # the time this step waited for it
            rollout, metrics = self.rollouts.take()
        batch, scored = self.score(rollout, timer)
        return batch, {**metrics, **scored}

    @contextmanager
    def push(self, timer: Timer, version: int) -> Iterator[None]:
        with timer("wait_rollout"):  # the push lands between generations
            self.rollouts.pause()
        yield
        self.rollouts.pushed(version)

    def close(self) -> None:
        self.rollouts.stop()

    def state_dict(self) -> dict:
        return {"async": self.rollouts.state_dict()}  # the generated batches not trained yet, with their versions

    def load_state_dict(self, state: dict, step: int) -> None:
        self.rollouts.load_state_dict(state.get("async") or {"next_index": step, "extra": 0, "ready": []})
        self.rollouts.pushed(step)  # the servers now hold the checkpoint's weights: version `step`


class OneStepOffProducer(_AheadProducer):
    """one_step_off: staleness 1 on a fixed schedule (`fill_window`: every rollout the gate allows
    runs before the push), so rollout j+1 is always generated with the weights of step j."""

    def __init__(self, generate: GenerateFn, score: Callable[[Rollout, Timer], Scored], recover: Callable[[], int],
                 *, stale_samples: str, limit: int):
        super().__init__(RolloutProducer(generate, max_staleness=1, stale_samples=stale_samples, fill_window=True,
                                         limit=limit, recover=recover), score)


class FullyAsyncProducer(_AheadProducer):
    """fully_async: generation runs whenever the gate (`max_staleness` versions) allows; with
    `partial_rollout` the push interrupts the generation in flight."""

    def __init__(self, generate: GenerateFn, score: Callable[[Rollout, Timer], Scored], recover: Callable[[], int],
                 fleet: RolloutFleet, *, max_staleness: int, stale_samples: str, partial_rollout: bool, limit: int):
        super().__init__(RolloutProducer(generate, max_staleness=max_staleness, stale_samples=stale_samples,
                                         limit=limit, recover=recover), score)
        self.fleet, self.partial_rollout = fleet, partial_rollout

    @contextmanager
    def push(self, timer: Timer, version: int) -> Iterator[None]:
        """With partial rollouts the push interrupts the generation in flight: its running requests
        abort and wait, and continue with the new weights. Unless a server is dead (the push restarts
        it, which needs idle servers: then the generation parks first, as without), also when it
        dies after this check, found by the pause."""
        if not self.partial_rollout:
            with super().push(timer, version):
                yield
            return
        interrupt = not self.fleet.dead_servers()
        with timer("wait_rollout"):
            self.rollouts.pause(interrupt)
            if interrupt and not self.fleet.pause_generation():
                interrupt = False
                self.rollouts.pause()
        try:
            yield
        finally:
            if interrupt:
                with timer("sync_weights"):  # part of the push
                    self.fleet.continue_generation()
        self.rollouts.pushed(version)


def make_producer(a: AsyncTrainingConfig, cluster: Cluster, limit: int, *, collect: Callable[[Timer], Scored],
                  generate: GenerateFn, score: Callable[[Rollout, Timer], Scored]) -> BatchProducer:
    """The producer of `async_training.mode` (`a`): `collect` is the sync step's generation,
    `generate` and `score` the async modes' (a rollout in the producer thread; its scored batch
    when taken); `limit`: the run's total steps. The async producers restart dead servers through
    the runtime (`cluster.recover`), on the controller's thread."""
    if a.mode == "sync":
        return SyncProducer(collect)
    if a.mode == "one_step_off":
        return OneStepOffProducer(generate, score, cluster.recover, stale_samples=a.stale_samples, limit=limit)
    return FullyAsyncProducer(generate, score, cluster.recover, cluster.rollout, max_staleness=a.max_staleness,
                              stale_samples=a.stale_samples, partial_rollout=a.partial_rollout, limit=limit)
