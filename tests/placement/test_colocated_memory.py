"""The colocated memory state machine (issue 40, finding 1; issue 49, finding 4: restarts): SGLang
0.5.23's rules for memory tags and the order around train -> push -> generate, with hand-written
expected moves."""
import pytest

from megarl.placement.colocated_memory import ColocatedMemory, IllegalMemoryMove, Moves
from megarl.placement.colocation import OffloadParts

ALL = OffloadParts(True, True, True)
PLAN = {"actor": ALL, "ref": OffloadParts(params=True)}


def step(memory: ColocatedMemory) -> list:
    """One colocated step's moves, each applied as the trainer does."""
    out = []
    for name in ("before_training", "before_push", "after_push"):
        moves = getattr(memory, name)()
        out.append((name, moves))
        memory.apply(moves)
    return out


def test_a_step_releases_then_frees_training_memory_before_each_resume():
    memory = ColocatedMemory(2, PLAN, releases=True)
    memory.apply(memory.before_training())  # the start: servers release, nothing to onload
    assert memory.released == [{"weights", "kv_cache", "cuda_graph"}] * 2
    train = memory.before_training()  # roles on the device at start
    assert train.release == {} and train.onload == ()  # already released, nothing offloaded yet
    memory.apply(train)
    # before the push: the actor keeps its parameters (the push reads them), the rest leaves, the
    # caches are emptied, and only then the servers' weights come back
    push = memory.before_push()
    assert push.offload == {"actor": OffloadParts(grads=True, optimizer=True), "ref": OffloadParts(params=True)}
    assert push.empty_cache and push.resume == {0: ("weights",), 1: ("weights",)}
    memory.apply(push)
    assert memory.flush_before_push() == [False, False]  # their KV cache is released: no /flush_cache
    rollout = memory.after_push()
    memory.apply(rollout)
    assert rollout.offload == {"actor": OffloadParts(params=True)}
    assert rollout.empty_cache and rollout.resume == {0: ("kv_cache", "cuda_graph"), 1: ("kv_cache", "cuda_graph")}
    assert memory.released == [set(), set()] and memory.offloaded == {"actor": ALL, "ref": OffloadParts(params=True)}

    train, _, _ = step(memory)  # the next step: servers release everything, every role comes back
    assert train[1].release == {0: ("weights", "kv_cache", "cuda_graph"), 1: ("weights", "kv_cache", "cuda_graph")}
    assert train[1].onload == ("actor", "ref")


def test_in_the_push_phase_the_push_asks_again_and_nothing_moves_until_a_server_restarts():
    """Issue 50: the loop enters the push phase (`push_phase`), then the push asks `before_push`
    again before each attempt: from the push phase's own state nothing moves (a second release of
    the weights would cost a release and a resume per server per step); once a server restarted
    (it holds all its memory) every server releases everything again, as between generations."""
    for releases in (True, False):
        memory = ColocatedMemory(2, PLAN, releases=releases)
        memory.apply(memory.before_training())
        memory.apply(memory.before_push())
        assert memory.before_push() == Moves({}, {}, {}, (), False)
    memory = ColocatedMemory(2, PLAN, releases=True)
    memory.apply(memory.before_training())
    memory.apply(memory.before_push())
    memory.server_restarted(1)
    again = memory.before_push()
    assert again.release == {0: ("weights",), 1: ("weights", "kv_cache", "cuda_graph")}
    assert again.resume == {0: ("weights",), 1: ("weights",)}


def test_a_restarted_server_starts_resident_and_is_released_before_it_is_resumed():
    """The failure of issue 40: after a restart the push resumed `weights` on a server that
    released nothing, which ends a SGLang 0.5.23 server (KeyError). Issue 49: the push then
    onloaded the actor beside the restarted server's KV cache; it releases everything first."""
    memory = ColocatedMemory(2, PLAN, releases=True)
    memory.apply(memory.before_training())
    memory.server_restarted(1)  # died while training; its new process holds all its memory
    push = memory.before_push()
    assert push.release == {1: ("weights", "kv_cache", "cuda_graph")}
    assert push.resume == {0: ("weights",), 1: ("weights",)}
    memory.apply(push)
    assert memory.flush_before_push() == [False, False]  # no KV cache is resident: nothing to flush
    rollout = memory.after_push()
    assert rollout.resume == {0: ("kv_cache", "cuda_graph"), 1: ("kv_cache", "cuda_graph")}
    memory.apply(rollout)
    assert memory.released == [set(), set()]


def test_before_a_restart_every_planned_part_leaves_the_device():
    """Issue 49: SGLang sizes a new server's KV cache from the memory free when it starts, which
    must be what the trainer leaves free while generating."""
    memory = ColocatedMemory(2, PLAN, releases=True)
    memory.apply(memory.before_training())  # training: every role on the device
    restart = memory.before_restart()
    assert restart.offload == PLAN and restart.empty_cache
    assert restart.release == restart.resume == {} and restart.onload == ()
    memory.apply(restart)
    memory.apply(memory.before_push())  # the push phase: only the actor's parameters on the device
    restart = memory.before_restart()
    assert restart.offload == {"actor": OffloadParts(params=True)} and restart.empty_cache
    memory.apply(restart)
    assert memory.before_restart() == Moves({}, {}, {}, (), False)  # the rollout phase: nothing left


def test_a_push_between_generations_has_every_server_release_before_the_actor_comes_back():
    """Issue 49: a server restarted at generation start gets the weights again while the others
    hold weights, KV cache and CUDA graphs; the actor (all of it) comes back only once they released."""
    memory = ColocatedMemory(2, PLAN, releases=True)
    step(memory)  # the rollout phase: every server holds all its memory
    memory.server_restarted(0)
    push = memory.before_push()
    assert push.release == {0: ("weights", "kv_cache", "cuda_graph"), 1: ("weights", "kv_cache", "cuda_graph")}
    assert push.onload == ("actor",) and push.resume == {0: ("weights",), 1: ("weights",)}


def test_moves_sglang_refuses_are_refused():
    memory = ColocatedMemory(1, {}, releases=True)
    with pytest.raises(IllegalMemoryMove, match=r"resuming \['weights'\] that it holds; SGLang 0.5.23 raises KeyError"):
        memory.server_resumed(0, ("weights",))
    memory.server_released(0, ("weights", "kv_cache", "cuda_graph"))
    with pytest.raises(IllegalMemoryMove, match="before its weights"):
        memory.server_resumed(0, ("kv_cache",))
    with pytest.raises(IllegalMemoryMove, match="unknown memory tags"):
        memory.server_released(0, ("gpu",))
    memory.server_resumed(0, ("weights",))
    memory.server_resumed(0, ("kv_cache", "cuda_graph"))
    with pytest.raises(IllegalMemoryMove):
        memory.server_resumed(0, ("kv_cache",))  # twice


def test_servers_that_keep_their_memory_are_flushed_never_released_or_resumed():
    memory = ColocatedMemory(2, PLAN, releases=False)
    for name, moves in step(memory) + step(memory):
        assert moves.release == {} and moves.resume == {}, name
    assert memory.flush_before_push() == [True, True]
    assert memory.released == [set(), set()]


def test_without_offload_or_release_there_is_nothing_to_do():
    memory = ColocatedMemory(1, {}, releases=False)
    for _, moves in step(memory):
        assert moves.release == moves.resume == moves.offload == {} and moves.onload == ()
        assert not moves.empty_cache
