"""A rollout server that dies during the weight push, on CPU with real processes (Ray, CPU-engine
servers, sglang-router), for the distributed (gloo) and the disk transport: the cluster restarts
the server and pushes again, so every server ends at the new version with the actor's weights; a
push that fails while every server is alive raises at once; a death past `max_server_restarts`
stops the run naming the server; a server that hangs (SIGSTOP) during the push makes it fail within
the sync's timeouts, and the cluster kills it by PID, restarts it and pushes again.

The seam: with the colocated servers' memory released (as after `training_phase`), server 1 is
stopped (SIGSTOP) once the push checked that every server runs and answers (`recover`, which
would otherwise kill it as hung), so the push waits in its first phase on it, while server 0
completes that phase (it resumes its weights' memory and, distributed, opens its update session);
then server 0 is killed (SIGKILL) and server 1 continued, and the push carries on into a dead
server. Distributed, server 0 is rank 1 of the weight-update group: gloo's broadcast stops at it,
so server 1 never gets the bucket and must be released by the actor dropping its end of the group
(else it would wait for its receive timeout, 300 s)."""
import contextlib
import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from megarl.placement.worker_group import WorkerGroupError
from megarl.rollout.client import RolloutClient
from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.protocol import SamplingParams
from megarl.trainer import experience
from megarl.runtime.rollout_fleet import RolloutServerLost
from megarl.workers.rollout_worker import RolloutWorker

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["distributed", "disk"])
def grpo(request, ray_two_gpus, tiny_assets, tiny_grpo_cluster, tmp_path_factory):
    """The tiny GRPO cluster with the transport `request.param` and a reward that varies (so the
    first step updates the weights); the tests below run in file order on it."""
    with tiny_grpo_cluster(tiny_assets, tmp_path_factory.mktemp("out"),
                           f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",
                           f"actor_rollout_ref.rollout.weight_sync_transport={request.param}") as cluster_and_trainer:
        yield cluster_and_trainer


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


def released(url: str, api_key: str) -> list[str]:
    return ServerControl(url, api_key, timeout_s=5).server_info()["internal_states"][0]["released_memory"]


def stop_after_the_liveness_check(cluster, pid: int) -> None:
    """SIGSTOP `pid` right after the cluster's next `recover` (the push's first step: every server
    runs and answers /health), so the push meets a stopped server in its first phase."""

    def recover(*args, **kwargs):
        del cluster.recover  # once: the cluster's own method again
        restarted = cluster.recover(*args, **kwargs)
        os.kill(pid, signal.SIGSTOP)
        return restarted

    cluster.recover = recover


def kill_during_push(cluster) -> threading.Thread:
    """Release the servers' memory, have server 1 stopped as the push starts (it will wait on it),
    and from a thread: once the push prepared server 0 (resumed its weights; 0.2 s for its update
    session to open), kill server 0, wait until its worker sees it dead, continue server 1.
    Returns the thread (started)."""
    fleet = cluster.rollout
    cluster.training_phase()
    victim, held = fleet.workers.call(RolloutWorker.status, timeout_s=30)
    assert "weights" in released(victim["url"], fleet.api_key)
    stop_after_the_liveness_check(cluster, held["pid"])

    def run():
        try:
            wait_for(lambda: "weights" not in released(victim["url"], fleet.api_key), "the push preparing server 0")
            time.sleep(0.2)
            os.kill(victim["pid"], signal.SIGKILL)
            wait_for(lambda: not fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]["running"], "server 0 dead")
        finally:
            os.kill(held["pid"], signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def logprob_gap(cluster, trainer, url: str) -> float:
    """max |server log-prob - actor log-prob| over the response tokens of 2 prompts sampled
    from the server at `url`."""
    prompts = trainer.train_data.take([0, 1])
    temperature = trainer.config.actor_rollout_ref.rollout.temperature
    with RolloutClient(url, api_key=cluster.rollout.api_key) as client:
        result = client.generate([p.input_ids for p in prompts],
                                 SamplingParams(max_new_tokens=8, temperature=temperature), seeds=[0, 1])
    batch = experience.experience_batch(prompts, result.samples, uid_prefix="check")
    actor = cluster.actor.compute_log_prob(batch, temperature)["log_probs"]
    return ((actor - batch["rollout_log_probs"]).abs() * batch["response_mask"]).max().item()


def test_a_server_killed_during_the_push_is_restarted_and_the_push_completes(grpo):
    cluster, trainer = grpo
    first = trainer.train_step()  # the actor's weights now differ from the checkpoint a restart loads
    assert first["sync/weight_version"] == 1 and first["faults/rollout_server_restarts"] == 0
    assert first["actor/grad_norm"] > 0
    victim = cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[0]

    killer = kill_during_push(cluster)
    started = time.monotonic()
    metrics = cluster.sync_weights()
    seconds = time.monotonic() - started
    killer.join(timeout=60)

    assert seconds < 60, f"the push took {seconds:.0f} s: a server waited for a bucket that never came"
    assert metrics["sync/weight_version"] == 2 and metrics["faults/rollout_server_restarts"] == 1
    assert cluster.weight_version == 2 and cluster.rollout.restarts == [1, 0]
    now = cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[0]
    assert now["running"] and now["pid"] != victim["pid"] and now["url"] == victim["url"]
    assert [ServerControl(u, cluster.rollout.api_key).weight_version() for u in cluster.rollout.urls] == ["2", "2"]
    assert [released(u, cluster.rollout.api_key) for u in cluster.rollout.urls] == [[], []]
    for url in cluster.rollout.urls:  # the restarted server too holds the actor's weights
        assert logprob_gap(cluster, trainer, url) < 1e-4


@contextlib.contextmanager
def a_live_server_refusing_the_push(cluster):
    """Yields what the push's error names. Disk: a file where the push writes its directory.
    Distributed: server 1 already in a weight-update session (its begin_weight_update refuses)."""
    if cluster.config.actor_rollout_ref.rollout.weight_sync_transport == "disk":
        sync_dir = Path(cluster.config.trainer.default_local_dir) / "weight_sync"
        sync_dir.rename(sync_dir.with_name("aside"))
        sync_dir.write_text("a file where the push writes its directory\n")
        try:
            yield str(sync_dir)
        finally:
            sync_dir.unlink()
            sync_dir.with_name("aside").rename(sync_dir)
    else:
        server = ServerControl(cluster.rollout.urls[1], cluster.rollout.api_key)
        server.begin_weight_update()
        try:
            yield "a weight-update session is already open"
        finally:
            with contextlib.suppress(ServerError):  # the failed push usually ends every session itself
                server.end_weight_update()


def test_a_push_failing_with_every_server_alive_is_not_retried(grpo):
    cluster, _ = grpo
    pids = [s["pid"] for s in cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)]
    with a_live_server_refusing_the_push(cluster) as named:
        with pytest.raises(WorkerGroupError) as failed:
            cluster.sync_weights()
    message = str(failed.value)
    assert "WeightSyncError" in message and named in message, message
    assert cluster.weight_version == 2 and cluster.rollout.restarts == [1, 0]
    assert [s["pid"] for s in cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)] == pids  # nothing restarted
    assert [ServerControl(u, cluster.rollout.api_key).weight_version() for u in cluster.rollout.urls] == ["2", "2"]
    assert cluster.sync_weights()["sync/weight_version"] == 3


SYNC_CALL_TIMEOUT_S = 5.0  # the weight sync's bound on each server call (SyncConfig.timeout_s) below


@contextlib.contextmanager
def server_calls_bounded(cluster, seconds: float):
    """The cluster's weight sync, and those it makes after a restart, with every server call bounded
    by `seconds` (`SyncConfig.timeout_s`, 600 s in the cluster's own), and the memory resumes around
    the push too (the fleet's `memory_call_timeout_s`); the cluster's own again after."""
    from megarl.sync.weight_sync import SyncConfig
    from megarl.runtime import cluster as cluster_module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cluster_module, "SyncConfig", functools.partial(SyncConfig, timeout_s=seconds))
        patch.setattr(cluster.rollout, "memory_call_timeout_s", seconds)  # the cluster's resumes around the push
        cluster._make_sync()
        yield
    cluster._make_sync()


def test_a_server_hanging_during_the_push_is_killed_restarted_and_the_push_completes(grpo):
    """Server 1 stopped once the push checked the servers: the push fails on it within the server
    calls' timeout (its first phase, then ending the sessions), `recover` finds no answer to
    /health, kills it by PID and restarts it, and the push goes through at the new version."""
    cluster, trainer = grpo
    fleet = cluster.rollout
    held = fleet.workers.call(RolloutWorker.status, timeout_s=30)[1]
    with server_calls_bounded(cluster, SYNC_CALL_TIMEOUT_S):
        cluster.training_phase()
        stop_after_the_liveness_check(cluster, held["pid"])
        started = time.monotonic()
        try:
            metrics = cluster.sync_weights()
        finally:
            vars(cluster).pop("recover", None)
        seconds = time.monotonic() - started
    # the prepare and the end of the sessions (2 x 5 s), the probe (10 s), the restart and the push
    # again: about 20 s here (2 cores shared with other work)
    assert seconds < 60, f"the push took {seconds:.0f} s"
    assert metrics["sync/weight_version"] == 4 and metrics["faults/rollout_server_restarts"] == 1
    assert cluster.weight_version == 4 and fleet.restarts == [1, 1]
    now = fleet.workers.call(RolloutWorker.status, timeout_s=30)[1]
    assert now["running"] and now["pid"] != held["pid"] and now["url"] == held["url"]
    with pytest.raises(ProcessLookupError):  # killed and reaped by its worker: nothing of it runs
        os.kill(held["pid"], 0)
    assert [ServerControl(u, fleet.api_key).weight_version() for u in fleet.urls] == ["4", "4"]
    assert [released(u, fleet.api_key) for u in fleet.urls] == [[], []]
    assert logprob_gap(cluster, trainer, fleet.urls[1]) < 1e-4  # the restarted server holds the actor's weights


def test_a_server_dying_during_the_push_past_max_server_restarts_stops_the_run(grpo):
    cluster, _ = grpo
    victim = cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[0]
    killer = kill_during_push(cluster)
    with pytest.raises(RolloutServerLost) as lost:
        cluster.sync_weights()
    killer.join(timeout=60)
    message = str(lost.value)
    assert f"rollout server 0 at {victim['url']} on node {cluster.rollout.workers.locations[0]} (" in message
    assert "killed by SIGKILL" in message and "max_server_restarts=1" in message
    assert isinstance(lost.value.__context__, WorkerGroupError)  # raised while handling the failed push
    assert cluster.weight_version == 4 and cluster.rollout.restarts == [1, 1]
