"""Each `async_training.mode`'s producer (megarl.trainer.producers) on its own: which one a config
gets, and what each does around the weight push, in the order the modes' design gives
(megarl.trainer.async_rollout's docstring): sync does nothing; the async modes pause the generation
ahead, push, and tell it the new version; fully_async with partial rollouts interrupts the
generation in flight (pause the servers, push, continue), falls back to waiting for it when a
server is dead or the servers refuse the pause, and continues the servers even when the push
fails. The buffer and the fleet are recorders here; the real ones are tested in
test_async_rollout.py and, together with these producers, in test_async_e2e.py."""
import pytest

from megarl.config.schema import AsyncTrainingConfig
from megarl.trainer.producers import (
    FullyAsyncProducer,
    OneStepOffProducer,
    SyncProducer,
    make_producer,
)
from megarl.trainer.timing import Timer


class Fleet:
    """The fleet's calls a producer makes, recorded in `events` (shared with `Rollouts`)."""

    def __init__(self, events: list, dead: bool = False, pauses: bool = True):
        self.events, self.dead, self.pauses = events, dead, pauses

    def dead_servers(self) -> list[int]:
        return [0] if self.dead else []

    def pause_generation(self) -> bool:
        self.events.append("servers paused" if self.pauses else "servers refused the pause")
        return self.pauses

    def continue_generation(self) -> None:
        self.events.append("servers continue")


class Runtime:
    """The runtime's parts a producer uses: its fleet and `recover` (which restarts nothing here)."""

    def __init__(self, fleet: Fleet):
        self.rollout = fleet

    def recover(self) -> int:
        return 0


class Rollouts:
    """Stands in for the producer thread's buffer (`RolloutProducer`): records the calls."""

    def __init__(self, events: list):
        self.events = events

    def pause(self, interrupt: bool = False) -> float:
        self.events.append("pause, generation runs on" if interrupt else "pause, generation waited for")
        return 0.0

    def pushed(self, version: int) -> None:
        self.events.append(f"pushed {version}")

    def load_state_dict(self, state: dict) -> None:
        self.events.append(("loaded", state))


def async_producer(mode: str, events: list, **fleet) -> OneStepOffProducer | FullyAsyncProducer:
    config = AsyncTrainingConfig(mode=mode, max_staleness=3, partial_rollout=mode == "fully_async")
    producer = make_producer(config, Runtime(Fleet(events, **fleet)), limit=10, collect=None, generate=None, score=None)
    producer.rollouts = Rollouts(events)
    return producer


def push(producer, events: list, fails: bool = False) -> Timer:
    timer = Timer()
    with producer.push(timer, version=4), timer("sync_weights"):
        events.append("push")
        if fails:
            raise RuntimeError("the push failed")
    return timer


def test_each_mode_gets_its_producer_with_its_staleness_and_schedule():
    fleet = Runtime(Fleet([]))
    sync = make_producer(AsyncTrainingConfig(), fleet, limit=10, collect=None, generate=None, score=None)
    assert isinstance(sync, SyncProducer)
    one = make_producer(AsyncTrainingConfig(mode="one_step_off", max_staleness=3), fleet, limit=10,
                        collect=None, generate=None, score=None)
    assert isinstance(one, OneStepOffProducer)
    assert (one.rollouts.max_staleness, one.rollouts.fill_window, one.rollouts.limit) == (1, True, 10)
    full = make_producer(AsyncTrainingConfig(mode="fully_async", max_staleness=3, stale_samples="regenerate"),
                         fleet, limit=10, collect=None, generate=None, score=None)
    assert isinstance(full, FullyAsyncProducer) and not full.partial_rollout
    assert (full.rollouts.max_staleness, full.rollouts.fill_window, full.rollouts.stale_samples) == (3, False,
                                                                                                    "regenerate")


def test_sync_generates_in_the_step_and_has_nothing_around_the_push_or_in_a_checkpoint():
    events = []
    producer = SyncProducer(lambda timer: ("batch", {"reward/mean": 1.0}))
    assert producer.take(Timer()) == ("batch", {"reward/mean": 1.0})
    push(producer, events)
    assert events == ["push"]
    assert producer.state_dict() == {}


def test_one_step_off_pushes_between_generations():
    events = []
    timer = push(async_producer("one_step_off", events), events)
    assert events == ["pause, generation waited for", "push", "pushed 4"]
    assert set(timer.seconds) == {"wait_rollout", "sync_weights"}


def test_fully_async_without_partial_rollouts_pushes_between_generations():
    events = []
    producer = async_producer("fully_async", events)
    producer.partial_rollout = False
    push(producer, events)
    assert events == ["pause, generation waited for", "push", "pushed 4"]


def test_partial_rollouts_interrupt_the_generation_for_the_push_and_continue_it():
    events = []
    timer = push(async_producer("fully_async", events), events)
    assert events == ["pause, generation runs on", "servers paused", "push", "servers continue", "pushed 4"]
    assert set(timer.seconds) == {"wait_rollout", "sync_weights"}


def test_partial_rollouts_wait_for_the_generation_when_the_servers_refuse_the_pause():
    events = []
    push(async_producer("fully_async", events, pauses=False), events)
    assert events == ["pause, generation runs on", "servers refused the pause", "pause, generation waited for",
                      "push", "pushed 4"]


def test_partial_rollouts_wait_for_the_generation_when_a_server_is_dead():
    events = []  # the push restarts it, which needs idle servers
    push(async_producer("fully_async", events, dead=True), events)
    assert events == ["pause, generation waited for", "push", "pushed 4"]


def test_a_failed_push_continues_the_interrupted_generation_and_sets_no_version():
    events = []
    with pytest.raises(RuntimeError, match="the push failed"):
        push(async_producer("fully_async", events), events, fails=True)
    assert events == ["pause, generation runs on", "servers paused", "push", "servers continue"]


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_async_checkpoints_resume_at_the_checkpoints_version(mode):
    events = []
    producer = async_producer(mode, events)
    producer.load_state_dict({"step": 3, "async": {"next_index": 5, "extra": 1, "ready": []}}, step=3)
    assert events == [("loaded", {"next_index": 5, "extra": 1, "ready": []}), "pushed 3"]
    events.clear()  # a checkpoint of a sync run: the producer starts at its step
    producer.load_state_dict({"step": 3}, step=3)
    assert events == [("loaded", {"next_index": 3, "extra": 0, "ready": []}), "pushed 3"]
