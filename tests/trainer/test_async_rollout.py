"""The rollout producer's schedule on its own (megarl.trainer.async_rollout): the versions that
generate each rollout, the staleness bound, dropping or regenerating stale rollouts, and its
checkpoint state. The generation is a plain function here (no servers): it records the version
it was given and returns that many samples; the servers' side is tested in test_async_e2e.py."""
import io
import threading
import time

import pytest
import torch

from megarl.rollout.client import Sample
from megarl.trainer.async_rollout import Rollout, RolloutInterrupted, RolloutProducer


class Generation:
    """generate(index, version, prompt_indices): one prompt per rollout, its prompt index the
    rollout index unless given; sleeps `seconds` (the servers' time)."""

    def __init__(self, seconds: float = 0.0):
        self.seconds, self.calls = seconds, []

    def __call__(self, index, version, prompt_indices):
        self.calls.append((index, version, prompt_indices))
        time.sleep(self.seconds)
        sample = Sample([index, version], [-0.5, -0.25], "length", None, "ab", str(version))
        return Rollout(index, f"s{index}", prompt_indices or [index], [[sample, sample]], version, generate_s=self.seconds)


def wait_for_calls(generation: Generation, count: int, timeout_s: float = 30.0) -> None:
    """Waits (bounded) until `generation` has been called `count` times: the producer's thread
    may be slow to run on a loaded machine, and the schedule under test must not depend on it."""
    deadline = time.monotonic() + timeout_s
    while len(generation.calls) < count:
        assert time.monotonic() < deadline, f"{len(generation.calls)} of {count} generations in {timeout_s} s"
        time.sleep(0.005)


def run(producer: RolloutProducer, steps: int, train_s: float, before_pause=None) -> list[dict]:
    """The controller's side of `steps` steps: take, train (sleep), pause, push;
    `before_pause(step)` runs after the training sleep."""
    metrics = []
    try:
        for step in range(steps):
            rollout, m = producer.take()
            assert rollout.index == step
            time.sleep(train_s)
            if before_pause is not None:
                before_pause(step)
            producer.pause()
            producer.pushed(step + 1)
            metrics.append(m)
    finally:
        producer.stop()
    return metrics


@pytest.mark.parametrize("gen_s,train_s", [(0.0, 0.05), (0.05, 0.0)])
def test_one_step_off_generates_rollout_j_with_version_j_minus_1_whatever_the_timings(gen_s, train_s):
    generation = Generation(gen_s)
    producer = RolloutProducer(generation, max_staleness=1, fill_window=True, limit=5)
    metrics = run(producer, 5, train_s)
    assert [(i, v) for i, v, _ in generation.calls] == [(0, 0), (1, 0), (2, 1), (3, 2), (4, 3)]
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_fully_async_runs_ahead_up_to_max_staleness_and_never_past_it():
    generation = Generation(0.0)  # generation faster than training: the gate alone holds it back

    def gate_reached(step: int) -> None:
        """At version `step` the gate lets rollouts up to index step + 2 start, and no further."""
        wait_for_calls(generation, min(6, step + 3))
        time.sleep(0.02)
        assert len(generation.calls) == min(6, step + 3)

    producer = RolloutProducer(generation, max_staleness=2, limit=6)
    metrics = run(producer, 6, 0.0, before_pause=gate_reached)
    assert [(i, v) for i, v, _ in generation.calls] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert all(m["async/dropped_samples"] == 0 for m in metrics)


def test_fully_async_with_slow_generation_trains_fresher_rollouts():
    generation = Generation(0.05)
    producer = RolloutProducer(generation, max_staleness=3, limit=4)
    metrics = run(producer, 4, 0.0)
    assert all(0 <= m["async/staleness_max"] <= 3 for m in metrics)
    assert all(index - version <= 3 for index, version, _ in generation.calls)


def stale_producer(stale_samples: str, generation: Generation) -> RolloutProducer:
    """A producer resumed at version 5 with max_staleness 2 from a checkpoint that holds rollout 3,
    generated at version 0 (e.g. saved by a run with a larger bound)."""
    producer = RolloutProducer(generation, max_staleness=2, stale_samples=stale_samples, limit=8)
    old = Generation()(3, 0, [42])
    producer.load_state_dict({"next_index": 4, "extra": 0, "ready": [old.state_dict()]})
    producer.pushed(5)
    return producer


def take_from_stale_producer(stale_samples: str, generation: Generation):
    """(producer, rollout, metrics): one `take()` from `stale_producer`, the producer stopped after."""
    producer = stale_producer(stale_samples, generation)
    try:
        return (producer, *producer.take())
    finally:
        producer.stop()


def test_a_rollout_past_the_bound_is_dropped_and_counted():
    generation = Generation()
    producer, rollout, metrics = take_from_stale_producer("drop", generation)
    assert metrics["async/dropped_samples"] == 2 and metrics["async/staleness_max"] == 0.0
    assert (rollout.index, rollout.version) == (4, 5) and producer.limit == 9


def test_a_rollout_past_the_bound_is_regenerated_with_its_prompts():
    generation = Generation()
    _, rollout, metrics = take_from_stale_producer("regenerate", generation)
    assert generation.calls[0] == (3, 5, [42])  # same rollout, same prompts, current weights
    assert (rollout.index, rollout.version, rollout.prompt_indices) == (3, 5, [42])
    assert metrics["async/regenerated_samples"] == 2 and metrics["async/staleness_max"] == 0.0


def test_the_state_round_trips_through_a_weights_only_checkpoint():
    generation = Generation()
    producer = RolloutProducer(generation, max_staleness=2, fill_window=True, limit=4)  # pause: 1 and 2 done
    producer.take()
    producer.pause()
    producer.pushed(1)
    state = producer.state_dict()
    producer.stop()
    buffer = io.BytesIO()
    torch.save({"async": state}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["async"]
    assert loaded == state and [r["index"] for r in state["ready"]] == [1, 2]
    again = RolloutProducer(generation, max_staleness=2, limit=4)
    again.load_state_dict(loaded)
    assert [(r.index, r.version, r.samples[0][0].weight_version) for r in again.ready] == [(1, 0, "0"), (2, 0, "0")]


def test_a_failed_generation_surfaces_in_the_controller():
    def broken(index, version, prompt_indices):
        raise ConnectionError("server gone")

    producer = RolloutProducer(broken, max_staleness=1, limit=2, wait_timeout_s=30)
    try:
        with pytest.raises(RuntimeError, match="server gone"):
            producer.take()
    finally:
        producer.stop()
    assert not any(t.name == "rollout-producer" and t.is_alive() for t in threading.enumerate())


class DyingServers:
    """A generation whose server dies during rollout `dies_at` (first attempt): it raises
    `RolloutInterrupted` with its first prompt answered; `recover()` restarts the server and
    records who called it and whether the controller was training then."""

    def __init__(self, dies_at: int):
        self.dies_at, self.dead, self.training = dies_at, False, False
        self.calls, self.recoveries = [], []

    def __call__(self, index, version, prompt_indices, partial=None):
        self.calls.append((index, version, prompt_indices, partial))
        if index == self.dies_at and partial is None:
            self.dead = True
            raise RolloutInterrupted(prompt_indices or [index, 100 + index], "answers to prompt 0")
        assert not self.dead, "generation sent to a dead server"
        sample = Sample([index, version], [-0.5, -0.25], "length", None, "ab", str(version))
        return Rollout(index, f"s{index}", prompt_indices or [index, 100 + index], [[sample], [sample]], version)

    def recover(self) -> int:
        self.recoveries.append((threading.current_thread() is threading.main_thread(), self.training))
        restarted, self.dead = int(self.dead), False
        return restarted


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_a_dead_server_is_restarted_by_the_controller_when_idle_and_the_rollout_finished(mode):
    servers = DyingServers(dies_at=2)
    producer = RolloutProducer(servers, max_staleness=1 if mode == "one_step_off" else 2,
                               fill_window=mode == "one_step_off", limit=5, recover=servers.recover)
    taken = []
    try:
        for step in range(5):
            rollout, _ = producer.take()
            taken.append((rollout.index, rollout.prompt_indices, rollout.version))
            servers.training = True
            time.sleep(0.02)
            servers.training = False
            producer.pause()
            producer.pushed(step + 1)
    finally:
        producer.stop()
    # every rollout trained once, in order, with the prompts of the uninterrupted schedule
    assert [(i, p) for i, p, _ in taken] == [(i, [i, 100 + i]) for i in range(5)]
    # restarted on the controller's thread while it was not training; the producer never did
    assert servers.recoveries and all(main and not training for main, training in servers.recoveries)
    resumed = [c for c in servers.calls if c[3] is not None]
    assert len(resumed) == 1 and resumed[0][0] == 2 and resumed[0][2] == [2, 102]
    assert resumed[0][3] == "answers to prompt 0"  # its answers so far, passed back
    first = next(c for c in servers.calls if c[0] == 2)
    assert dict((i, v) for i, _, v in taken)[2] == first[1]  # it keeps the version of its first part


def test_an_interrupted_rollout_is_checkpointed_as_its_prompts():
    servers = DyingServers(dies_at=0)
    producer = RolloutProducer(servers, max_staleness=1, limit=2, recover=servers.recover, wait_timeout_s=30)
    producer._paused = False  # let the producer start rollout 0 without taking it
    with producer._cond:
        producer._cond.notify_all()
    producer._thread = threading.Thread(target=producer._run, daemon=True)
    producer._thread.start()
    try:
        with producer._cond:
            assert producer._cond.wait_for(lambda: producer._parked, timeout=30)
        producer.pause()  # returns at once: nothing generates while parked
        state = producer.state_dict()
    finally:
        producer.stop()
    assert state["interrupted"] == {"index": 0, "version": 0, "prompt_indices": [0, 100]}
    again = RolloutProducer(servers, max_staleness=1, limit=2, recover=servers.recover)
    again.load_state_dict(state)
    servers.dead, before = False, len(servers.calls)
    try:
        rollout, _ = again.take()
    finally:
        again.stop()
    assert (rollout.index, rollout.prompt_indices) == (0, [0, 100])
    assert servers.calls[before] == (0, 0, [0, 100], None)  # generated whole from its prompts


def test_a_regeneration_cut_by_a_dead_server_is_finished_after_a_restart_on_the_controllers_thread():
    servers = DyingServers(dies_at=3)
    producer = stale_producer("regenerate", servers)
    producer._recover = servers.recover
    try:
        rollout, _ = producer.take()
    finally:
        producer.stop()
    assert (rollout.index, rollout.prompt_indices, rollout.version) == (3, [42], 5)
    assert servers.calls[:2] == [(3, 5, [42], None), (3, 5, [42], "answers to prompt 0")]
    assert servers.recoveries == [(True, False)]


def test_a_checkpoint_after_an_interrupting_push_holds_the_partial_rollout_whole():
    """Partial rollouts: `pause(interrupt=True)` lets the running generation go on across the
    push; the checkpoint's `state_dict()` waits for it to finish, so the buffer it saves holds that
    rollout whole (tokens from both versions, per-token versions, the version it started with),
    and a resumed producer trains it next."""
    running, release = threading.Event(), threading.Event()

    def generation(index, version, prompt_indices, partial=None):
        if index == 1:  # continued across the push to version 1
            running.set()
            assert release.wait(30)
            sample = Sample([1, 2], [-0.5, -0.25], "length", None, "ab", "1", ["0", "1"])
        else:
            sample = Sample([index], [-0.5], "length", None, "a", str(version))
        return Rollout(index, f"s{index}", [index], [[sample]], version)

    producer = RolloutProducer(generation, max_staleness=1, limit=3, wait_timeout_s=30)
    saved = {}
    saver = threading.Thread(target=lambda: saved.update(state=producer.state_dict()))
    try:
        producer.take()  # rollout 0; the producer starts rollout 1
        assert running.wait(30)
        producer.pause(interrupt=True)  # returns with rollout 1 running
        producer.pushed(1)
        saver.start()
        saver.join(0.5)
        assert saver.is_alive() and "state" not in saved  # waits for rollout 1
        release.set()
        saver.join(30)
    finally:
        release.set()
        producer.stop()
    state = saved["state"]
    assert state["next_index"] == 2 and [(r["index"], r["version"]) for r in state["ready"]] == [(1, 0)]
    assert state["ready"][0]["samples"] == [[{"token_ids": [1, 2], "logprobs": [-0.5, -0.25], "finish_reason": "length",
                                              "matched": None, "text": "ab", "weight_version": "1",
                                              "weight_versions": ["0", "1"]}]]
    again = RolloutProducer(generation, max_staleness=1, limit=3, wait_timeout_s=30)
    again.load_state_dict(state)
    again.pushed(1)
    try:
        rollout, metrics = again.take()
    finally:
        again.stop()
    assert (rollout.index, rollout.version, rollout.samples[0][0].weight_versions) == (1, 0, ["0", "1"])
    assert metrics["async/staleness_max"] == 1.0
