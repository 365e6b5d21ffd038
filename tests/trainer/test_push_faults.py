"""A rollout server that dies during the weight push, on CPU with real processes (Ray, CPU-engine
servers, sglang-router; the disk transport, whose push is a sequence of HTTP calls): the cluster
restarts the server and pushes again, so every server ends at the new version with the actor's
weights; a push that fails while every server is alive raises at once; a death past
`max_server_restarts` stops the run naming the server.

The seam: with the colocated servers' memory released (as after `before_training`), server 0 is
stopped (SIGSTOP) before the push, so the push waits in its first phase on it, while server 1
completes that phase (it resumes its weights' memory); then server 1 is killed (SIGKILL) and
server 0 continued, and the push carries on into a dead server."""
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from megarl.placement.worker_group import WorkerGroupError
from megarl.rollout.client import RolloutClient
from megarl.rollout.control import ServerControl
from megarl.rollout.protocol import SamplingParams
from megarl.trainer import experience
from megarl.trainer.rollout_fleet import RolloutServerLost

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def grpo(ray_two_gpus, tiny_assets, tiny_grpo_cluster, tmp_path_factory):
    """The tiny GRPO cluster with the disk transport and a reward that varies (so the first step
    updates the weights); the tests below run in file order on it."""
    with tiny_grpo_cluster(tiny_assets, tmp_path_factory.mktemp("out"),
                           f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",
                           "actor_rollout_ref.rollout.weight_sync_transport=disk") as cluster_and_trainer:
        yield cluster_and_trainer


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.01)


def released(url: str) -> list[str]:
    return ServerControl(url, timeout_s=5).server_info()["internal_states"][0]["released_memory"]


def kill_during_push(cluster) -> threading.Thread:
    """Release the servers' memory, stop server 0 (the push will wait on it), and from a thread:
    once the push resumed server 1's weights, kill server 1, wait until its worker sees it dead,
    continue server 0. Returns the thread (started)."""
    fleet = cluster.rollout
    cluster.before_training()
    held, victim = fleet.workers.call("status", timeout_s=30)
    assert "weights" in released(victim["url"])
    os.kill(held["pid"], signal.SIGSTOP)

    def run():
        try:
            wait_for(lambda: "weights" not in released(victim["url"]), "the push preparing server 1")
            os.kill(victim["pid"], signal.SIGKILL)
            wait_for(lambda: not fleet.workers.call("status", timeout_s=30)[1]["running"], "server 1 dead")
        finally:
            os.kill(held["pid"], signal.SIGCONT)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def last_push_attempt(cluster) -> int:
    """The attempt number in the name of the newest push directory of the disk transport."""
    pushes = sorted((Path(cluster.config.trainer.default_local_dir) / "weight_sync").glob("push-*"))
    return int(pushes[-1].name.split("-")[1])


def logprob_gap(cluster, trainer, url: str) -> float:
    """max |server log-prob - actor log-prob| over the response tokens of 2 prompts sampled
    from the server at `url`."""
    prompts = trainer.train_data.take([0, 1])
    temperature = trainer.config.actor_rollout_ref.rollout.temperature
    result = RolloutClient(url).generate([p.input_ids for p in prompts],
                                         SamplingParams(max_new_tokens=8, temperature=temperature), seeds=[0, 1])
    batch = experience.experience_batch(prompts, result.samples, uid_prefix="check")
    actor = cluster.actor.compute("compute_log_prob", batch, temperature)["log_probs"]
    return ((actor - batch["rollout_log_probs"]).abs() * batch["response_mask"]).max().item()


def test_a_server_killed_during_the_push_is_restarted_and_the_push_completes(grpo):
    cluster, trainer = grpo
    first = trainer.train_step()  # the actor's weights now differ from the checkpoint a restart loads
    assert first["sync/weight_version"] == 1 and first["faults/rollout_server_restarts"] == 0
    assert first["actor/grad_norm"] > 0
    victim = cluster.rollout.workers.call("status", timeout_s=30)[1]

    killer = kill_during_push(cluster)
    metrics = cluster.sync_weights()
    killer.join(timeout=60)

    assert metrics["sync/weight_version"] == 2 and metrics["faults/rollout_server_restarts"] == 1
    assert cluster.weight_version == 2 and cluster.rollout.restarts == [0, 1]
    now = cluster.rollout.workers.call("status", timeout_s=30)[1]
    assert now["running"] and now["pid"] != victim["pid"] and now["url"] == victim["url"]
    assert [ServerControl(u).weight_version() for u in cluster.rollout.urls] == ["2", "2"]
    assert [released(u) for u in cluster.rollout.urls] == [[], []]
    for url in cluster.rollout.urls:  # the restarted server too holds the actor's weights
        assert logprob_gap(cluster, trainer, url) < 1e-4


def test_a_push_failing_with_every_server_alive_is_not_retried(grpo):
    cluster, _ = grpo
    before = last_push_attempt(cluster)
    sync_dir = Path(cluster.config.trainer.default_local_dir) / "weight_sync"
    sync_dir.rename(sync_dir.with_name("aside"))
    sync_dir.write_text("a file where the push writes its directory\n")
    try:
        with pytest.raises(WorkerGroupError) as failed:
            cluster.sync_weights()
    finally:
        sync_dir.unlink()
        sync_dir.with_name("aside").rename(sync_dir)
    message = str(failed.value)
    assert "WeightSyncError" in message and str(sync_dir) in message, message
    assert cluster.weight_version == 2 and cluster.rollout.restarts == [0, 1]
    assert [ServerControl(u).weight_version() for u in cluster.rollout.urls] == ["2", "2"]
    assert cluster.sync_weights()["sync/weight_version"] == 3
    assert last_push_attempt(cluster) == before + 2  # the failed attempt, then this one: no retry between


def test_a_server_dying_during_the_push_past_max_server_restarts_stops_the_run(grpo):
    cluster, _ = grpo
    victim = cluster.rollout.workers.call("status", timeout_s=30)[1]
    killer = kill_during_push(cluster)
    with pytest.raises(RolloutServerLost) as lost:
        cluster.sync_weights()
    killer.join(timeout=60)
    message = str(lost.value)
    assert f"rollout server 1 at {victim['url']} on node {cluster.rollout.workers.locations[1]} (" in message
    assert "killed by SIGKILL" in message and "max_server_restarts=1" in message
    assert isinstance(lost.value.__context__, WorkerGroupError)  # raised while handling the failed push
    assert cluster.weight_version == 3 and cluster.rollout.restarts == [0, 1]
