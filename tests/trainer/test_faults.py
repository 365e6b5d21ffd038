"""Faults during a run, on CPU with real processes: a rollout server killed by PID is restarted,
brought to the current weights and its lost requests retried (the step completes, the restart is
counted); a server that hangs (SIGSTOP) mid-generation is found by its unanswered `/health`,
killed by PID and restarted the same way, within a bound; a server that dies or hangs too often
stops the run naming it; a dead training worker is named by role, rank, node and cause."""
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from megarl.config import load_and_validate
from megarl.placement import plan_from_config
from megarl.placement.ray_pools import create_pools
from megarl.placement.worker_group import WorkerGroupError
from megarl.rollout.client import RolloutClient
from megarl.rollout.control import ServerControl
from megarl.rollout.protocol import SamplingParams
from megarl.runtime.rollout_fleet import HUNG_AFTER_S, GenerationInterrupted, RolloutFleet, RolloutServerLost
from megarl.workers.rollout_worker import RolloutWorker
from megarl.workers.train_worker import TrainWorker

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def kill_once_busy(server: dict, timeout_s: float = 60.0) -> None:
    """SIGKILL the server's process as soon as it reports requests running (mid-generation,
    however fast this machine generates)."""
    control, deadline = ServerControl(server["url"], timeout_s=5), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if control.server_info()["internal_states"][0]["num_running_requests"] > 0:
            break
        time.sleep(0.01)
    os.kill(server["pid"], signal.SIGKILL)


def wait_until_dead(fleet, server: int, timeout_s: float = 30.0) -> None:
    """Until the worker sees its server process gone (a killed child stays a zombie until reaped)."""
    deadline = time.monotonic() + timeout_s
    while fleet.workers.call(RolloutWorker.status, timeout_s=30)[server]["running"]:
        assert time.monotonic() < deadline, f"server {server} still running after {timeout_s} s"
        time.sleep(0.1)


def test_fleet_survives_a_server_killed_mid_generation_and_stops_past_the_limit(ray_two_gpus, tiny_assets, tmp_path):
    config = load_and_validate(None, [
        f"actor_rollout_ref.model.path={tiny_assets / 'model'}", "data.train_files=/unused.parquet",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=cpu", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.dtype=float32", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_prompt_length=16", "data.max_response_length=96",
        "actor_rollout_ref.rollout.max_server_restarts=1", f"trainer.default_local_dir={tmp_path}",
    ])
    plan = plan_from_config(config)
    pools = create_pools(plan, timeout_s=60)
    fleet = RolloutFleet(plan.roles["rollout"], pools, config, colocated=True, single_node=True,
                         startup_timeout_s=180)

    def restart_failed() -> int:  # what the runtime's `recover` has the fleet do (no weight sync here)
        dead = fleet.take_down_failed()
        fleet.restart(dead)
        fleet.rejoin(dead)
        return len(dead)

    try:
        prompts = [[2, 10 + i % 20, 11 + i % 20] for i in range(24)]
        sampling = SamplingParams(max_new_tokens=96, n=2, ignore_eos=True)
        victim = fleet.workers.call(RolloutWorker.status, timeout_s=30)[1]
        killer = threading.Thread(target=kill_once_busy, args=(victim,), daemon=True)
        killer.start()
        seeds = list(range(len(prompts)))
        try:
            result = fleet.generate(prompts, sampling, seeds=seeds)
        except GenerationInterrupted as cut:  # the death lost prompts: restarted, the lost ones sent again
            assert restart_failed() == 1
            result = fleet.generate(prompts, sampling, seeds=seeds, partial=cut)
        killer.join()
        assert [[len(s.token_ids) for s in row] for row in result.samples] == [[96, 96]] * len(prompts)
        # Restarted above when the death lost prompts; when the router sent them to the other
        # server instead, by the next restart, which the push or the next generation runs first.
        restarted_before = sum(fleet.restarts)
        assert restart_failed() == 1 - restarted_before
        now = fleet.workers.call(RolloutWorker.status, timeout_s=30)[1]
        assert now["running"] and now["pid"] != victim["pid"] and now["url"] == victim["url"]
        assert fleet.restarts == [0, 1]
        assert sorted(w["url"] for w in fleet.router.workers()) == sorted(fleet.urls)
        faults = fleet.fault_metrics()
        assert faults["faults/rollout_server_restarts"] == 1
        assert faults["faults/rollout_requests_retried"] == result.metrics.retried_requests
        assert fleet.fault_metrics()["faults/rollout_server_restarts"] == 0  # counted once

        # A second death of the same server is one more than max_server_restarts=1 allows.
        os.kill(now["pid"], signal.SIGKILL)
        wait_until_dead(fleet, 1)
        with pytest.raises(RolloutServerLost) as lost:
            restart_failed()
        message = str(lost.value)
        assert f"rollout server 1 at {now['url']} on node " in message
        assert "127.0.0.1" in message or now["ip"] in message
        assert "killed by SIGKILL" in message and "max_server_restarts=1" in message
        assert f"Last lines of its log {now['log_path']}" in message
        pids = [s["pid"] for s in fleet.workers.call(RolloutWorker.status, timeout_s=30)]
    finally:
        fleet.shutdown()
        pools.remove()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ---------------------------------------------------------------------------- the whole cluster
# One tiny GRPO cluster (TP=2 actor, two CPU-engine servers, colocated) for the tests below, which
# run in file order: server 1 killed before a step, server 0 stopped mid-generation, a training
# worker killed, server 1 killed once too often, server 0 stopped once too often.

REQUEST_TIMEOUT_S = 5  # actor_rollout_ref.rollout.request_timeout_s here (a tiny model's request takes < 1 s)


@pytest.fixture(scope="module")
def grpo(ray_two_gpus, tiny_assets, tiny_grpo_cluster, tmp_path_factory):
    with tiny_grpo_cluster(tiny_assets, tmp_path_factory.mktemp("out"),
                           f"actor_rollout_ref.rollout.request_timeout_s={REQUEST_TIMEOUT_S}") as cluster_and_trainer:
        yield cluster_and_trainer


def greedy(url: str, prompt: list[int], api_key: str):
    with RolloutClient(url, api_key=api_key) as client:
        return client.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0.0)).samples[0][0]


def test_fleet_servers_refuse_requests_without_the_runs_api_key(grpo):
    """The servers listen on the node's address: without the run's key (a fresh random one, as no
    actor_rollout_ref.rollout.api_key_env is set) nobody may generate with them, release their memory or
    push weights into them (401, SGLang's --api-key rule), and the key is in no file the run wrote."""
    import requests

    cluster, _ = grpo
    key, url = cluster.rollout.api_key, cluster.rollout.urls[0]
    assert isinstance(key, str) and len(key) >= 40
    generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    for path, body, headers in [("/generate", generate, {}),
                                ("/generate", generate, {"Authorization": "Bearer not-the-key"}),
                                ("/release_memory_occupation", {}, {}),
                                ("/update_weights_from_disk", {"model_path": "/tmp/x"}, {})]:
        assert requests.post(url + path, json=body, headers=headers, timeout=30).status_code == 401, path
    assert requests.get(url + "/health", timeout=30).status_code == 200  # open, as SGLang's
    ok = requests.post(url + "/generate", json=generate, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 1
    written = [f for f in Path(cluster.config.trainer.default_local_dir).rglob("*") if f.is_file()]
    assert any(f.name.startswith("rollout-") for f in written)  # the servers' logs, with their command lines
    assert not [f for f in written if key.encode() in f.read_bytes()]


def test_step_completes_after_a_rollout_server_is_killed(grpo):
    cluster, trainer = grpo
    first = trainer.train_step()
    assert first["faults/rollout_server_restarts"] == 0 and first["sync/weight_version"] == 1
    victim = cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[1]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until_dead(cluster.rollout, 1)

    metrics = trainer.train_step()
    assert metrics["faults/rollout_server_restarts"] == 1
    assert metrics["faults/rollout_requests_retried"] >= 0 and metrics["rollout/samples"] == 4 * 4
    assert metrics["sync/weight_version"] == 2 and cluster.rollout.restarts == [0, 1]
    now = cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[1]
    assert now["running"] and now["pid"] != victim["pid"]
    assert [ServerControl(u, cluster.rollout.api_key).weight_version() for u in cluster.rollout.urls] == ["2", "2"]
    prompt = trainer.train_data.take([0])[0].input_ids
    key = cluster.rollout.api_key
    restarted, other = greedy(cluster.rollout.urls[1], prompt, key), greedy(cluster.rollout.urls[0], prompt, key)
    assert restarted.weight_version == other.weight_version == "2"
    assert restarted.token_ids == other.token_ids and len(restarted.token_ids) > 0


def stop_as_generation_starts(fleet, pid: int) -> None:
    """SIGSTOP `pid` when the fleet's client starts its next generation, after the generation's own
    check of the servers: the requests the router sends it are accepted by the kernel and never
    answered, as those of a server that hangs while generating."""
    client = fleet.client

    def generate(*args, **kwargs):
        del client.generate  # once: the client's own method again
        os.kill(pid, signal.SIGSTOP)
        return client.generate(*args, **kwargs)

    client.generate = generate


def test_step_completes_after_a_rollout_server_hangs_mid_generation(grpo):
    """Its requests end after request_timeout_s and, not sent again by the client here (max_retries=0:
    otherwise its retries may reach the other server once the router's health checks drop the hung
    one, and the `recover` before training finds it), are lost: the fleet's `recover` finds no answer
    to /health, kills the server by PID, restarts it and sends the lost prompts again."""
    cluster, trainer = grpo
    fleet = cluster.rollout
    victim = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    stop_as_generation_starts(fleet, victim["pid"])
    retries, fleet.client.max_retries = fleet.client.max_retries, 0
    started = time.monotonic()
    try:
        metrics = trainer.train_step()
    finally:
        vars(fleet.client).pop("generate", None)
        fleet.client.max_retries = retries
    seconds = time.monotonic() - started
    # at most: the stuck requests' 5 s, the probe (10 s), a restart and a push at the current version,
    # the prompts sent again, the rest of the step (about 20 s here; 2 cores shared with other work)
    assert seconds < 75, f"the step took {seconds:.0f} s"
    assert metrics["faults/rollout_server_restarts"] == 1 and fleet.restarts == [1, 1]
    assert metrics["faults/rollout_requests_retried"] >= 1  # the prompts lost with it, sent again
    assert metrics["rollout/samples"] == 4 * 4 and metrics["sync/weight_version"] == 3
    now = fleet.workers.call(RolloutWorker.status, HUNG_AFTER_S, timeout_s=60)[0]
    assert now["running"] and now["answers"] and now["pid"] != victim["pid"] and now["url"] == victim["url"]
    with pytest.raises(ProcessLookupError):  # killed and reaped by its worker: nothing of it runs
        os.kill(victim["pid"], 0)
    assert "killed (SIGKILL to its process group): hung: no answer to /health within" in \
        Path(victim["log_path"]).read_text()
    assert [ServerControl(u, fleet.api_key).weight_version() for u in fleet.urls] == ["3", "3"]


def test_training_worker_death_is_named(grpo):
    cluster, _ = grpo
    victim = cluster.actor.workers.call(TrainWorker.node_info, timeout_s=60)[1]
    os.kill(victim["pid"], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerGroupError) as died:
        cluster.sync_weights()  # every actor rank takes part; rank 0 waits on rank 1 in a collective
    assert time.monotonic() - started < 60
    message = str(died.value)
    where = cluster.actor.workers.locations[1]
    assert f"actor rank 1 on {where} died: the worker process (pid {victim['pid']}, node " in message, message
    assert "exited unexpectedly (SIGKILL, the OOM killer or a crash?)" in message, message
    assert 'File "' not in message, message  # one line per rank, no tracebacks


def test_a_server_dying_past_max_server_restarts_stops_the_run(grpo):
    cluster, trainer = grpo
    status = cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[1]
    os.kill(status["pid"], signal.SIGKILL)
    wait_until_dead(cluster.rollout, 1)
    with pytest.raises(RolloutServerLost) as lost:
        trainer.train_step()
    message = str(lost.value)
    assert f"rollout server 1 at {status['url']} on node {cluster.rollout.workers.locations[1]} (" in message
    assert "killed by SIGKILL" in message and "max_server_restarts=1" in message
    assert f"Last lines of its log {status['log_path']}" in message


def test_a_server_hanging_past_max_server_restarts_stops_the_run_naming_it(grpo):
    """Server 0 hung once already (restarted); hung again, the run stops with `RolloutServerLost`
    naming it hung, and its stopped process is killed, not left behind."""
    cluster, _ = grpo
    fleet = cluster.rollout
    status = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    assert fleet.restarts[0] == 1 and status["running"]
    os.kill(status["pid"], signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(RolloutServerLost) as lost:
        cluster.recover()
    assert time.monotonic() - started < 2 * HUNG_AFTER_S + 30  # the probe, the kill, the log's tail
    message = str(lost.value)
    assert f"rollout server 0 at {status['url']} on node {fleet.workers.locations[0]} (" in message
    assert "hung (alive, but no answer to /health within" in message and "died" not in message.splitlines()[0]
    assert "max_server_restarts=1" in message and f"Last lines of its log {status['log_path']}" in message
    with pytest.raises(ProcessLookupError):
        os.kill(status["pid"], 0)
