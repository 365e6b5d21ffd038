"""Rollout servers placed by the plan as Ray actors, behind the real router; a killed server is
restarted by the fleet before the next generation, and the fleet stops every process it started.
Their logs are in the run's logs/ directory (issue 26 item 10)."""
import os
import signal
import time

import pytest

from megarl.config import ConfigError, load_and_validate
from megarl.data.tiny_model import make_tiny_model
from megarl.placement import plan_from_config
from megarl.placement.ray_pools import create_pools
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.launch import server_startup_timeout_s
from megarl.runtime.rollout_fleet import RolloutFleet, RolloutServerLost
from megarl.workers.rollout_worker import RolloutWorker


def test_fleet_generates_restarts_and_stops(ray_two_gpus, tmp_path):
    make_tiny_model("qwen2", tmp_path / "model", seed=0)
    config = load_and_validate(None, [
        f"actor_rollout_ref.model.path={tmp_path / 'model'}", "data.train_files=/unused.parquet",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.name=cpu", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.dtype=float32", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_prompt_length=16", "data.max_response_length=8", f"trainer.default_local_dir={tmp_path}",
        "trainer.project_name=p", "trainer.experiment_name=e",
    ])
    plan = plan_from_config(config)
    pools = create_pools(plan, timeout_s=60)
    fleet = RolloutFleet(plan.roles["rollout"], pools, config, colocated=True, single_node=True,
                         startup_timeout_s=180)
    try:
        assert len(fleet.urls) == 2 and len(set(fleet.urls)) == 2
        prompts = [[1, 10 + i, 11 + i] for i in range(6)]
        result = fleet.generate(prompts, SamplingParams(max_new_tokens=4, n=2, ignore_eos=True))
        assert [[len(s.token_ids) for s in row] for row in result.samples] == [[4, 4]] * 6
        assert all(len(s.logprobs) == 4 for row in result.samples for s in row)

        statuses = fleet.workers.call(RolloutWorker.status, timeout_s=30)
        os.kill(statuses[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while fleet.workers.call(RolloutWorker.status, timeout_s=60)[1]["running"]:  # until the worker sees it gone
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert fleet.take_down_failed() == [1]  # what the runtime's `recover` has the fleet do
        fleet.restart([1])
        fleet.rejoin([1])
        result = fleet.generate(prompts, SamplingParams(max_new_tokens=3, n=2, ignore_eos=True))
        now = fleet.workers.call(RolloutWorker.status, timeout_s=60)[1]
        assert now["restarts"] == 1 and now["running"] and now["pid"] != statuses[1]["pid"]
        assert sum(len(s.token_ids) for row in result.samples for s in row) == 6 * 2 * 3
        pids = [s["pid"] for s in fleet.workers.call(RolloutWorker.status, timeout_s=30)]
        logs = tmp_path / "p/e/logs"
        assert [s["log_path"] for s in fleet.workers.call(RolloutWorker.status, timeout_s=30)] == [
            str(logs / "rollout-0.log"), str(logs / "rollout-1.log")]
        assert fleet.router.process.log_path == str(logs / "sglang-router.log")
        # one header line per start: the router's log says what it is, the restarted server's shows both starts
        assert (logs / "sglang-router.log").read_text().startswith("# megarl: ")
        assert "sglang-router started: " in (logs / "sglang-router.log").read_text()
        assert (logs / "rollout-1.log").read_text().count("rollout-1 started: ") == 2
    finally:
        fleet.shutdown()
        pools.remove()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_server_slower_to_start_than_the_key_allows_is_named_with_the_key(ray_two_gpus, tmp_path):
    """actor_rollout_ref.rollout.server_startup_timeout_s bounds the start (and every restart): a
    CPU server cannot load and answer /health in 0.5 s; the fleet says so naming the key, and
    stops what it started."""
    make_tiny_model("qwen2", tmp_path / "model", seed=0)
    config = load_and_validate(None, [
        f"actor_rollout_ref.model.path={tmp_path / 'model'}", "data.train_files=/unused.parquet",
        "actor_rollout_ref.rollout.name=cpu", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.server_startup_timeout_s=0.5", f"trainer.default_local_dir={tmp_path}",
        "trainer.project_name=p", "trainer.experiment_name=e"])
    plan = plan_from_config(config)
    pools = create_pools(plan, timeout_s=60)
    timeout = server_startup_timeout_s("cpu", config.actor_rollout_ref.rollout.server_startup_timeout_s)
    try:
        with pytest.raises(RolloutServerLost) as lost:
            RolloutFleet(plan.roles["rollout"], pools, config, colocated=True, single_node=True,
                         startup_timeout_s=timeout)
    finally:
        pools.remove()
    message = str(lost.value)
    assert message.startswith("the rollout servers did not start (each may take "
                              "actor_rollout_ref.rollout.server_startup_timeout_s=0.5 s to answer /health")
    assert "not healthy after 0 s" in message or "not healthy after 1 s" in message, message


def test_the_startup_timeout_by_engine():
    """Unset, 30 minutes for SGLang on GPUs (a large checkpoint from a network filesystem, CUDA
    graphs), 10 for the CPU engine; a value set wins."""
    assert server_startup_timeout_s("sglang", None) == 1800.0
    assert server_startup_timeout_s("cpu", None) == 600.0
    assert server_startup_timeout_s("sglang", 3600) == 3600.0
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.server_startup_timeout_s=0.0: must be > 0"):
        load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet",
                                 "actor_rollout_ref.rollout.server_startup_timeout_s=0"])


def test_the_nodes_of_a_multi_node_server_meet_at_its_node_0_address():
    """Planner order (server, node rank): server 0 on two nodes, server 1 on one, server 2 on two."""
    from megarl.rollout.launch import MultiNode
    from megarl.runtime.rollout_fleet import multi_node_args

    members = [[0, 1], [2], [3, 4]]
    args = multi_node_args(members, {0: "10.0.0.1:29500", 3: "10.0.0.3:29501"})
    assert args == [MultiNode(2, 0, "10.0.0.1:29500"), MultiNode(2, 1, "10.0.0.1:29500"), None,
                    MultiNode(2, 0, "10.0.0.3:29501"), MultiNode(2, 1, "10.0.0.3:29501")]
    assert multi_node_args([[0], [1]], {}) == [None, None]


def test_the_log_header_hides_the_api_key():
    from megarl.rollout.process import _without_secrets

    assert _without_secrets(["router", "--api-key", "s3cret", "--port", "1"]) == ["router", "--api-key", "***", "--port", "1"]


def test_a_fresh_api_key_per_run_or_the_users_from_an_environment_variable(monkeypatch):
    from megarl.rollout.launch import rollout_api_key

    first, second = rollout_api_key(None), rollout_api_key(None)
    assert first != second and len(first) == 64 and set(first) <= set("0123456789abcdef")  # 32 random bytes
    # hex never starts with "-", which argparse (SGLang's, the CPU server's) would take for an option
    keys = [rollout_api_key(None) for _ in range(2000)]
    assert not [k for k in keys if k.startswith("-")]
    monkeypatch.setenv("MY_ROLLOUT_KEY", "the-users-key")
    assert rollout_api_key("MY_ROLLOUT_KEY") == "the-users-key"
    base = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"]
    config = load_and_validate(None, [*base, "actor_rollout_ref.rollout.api_key_env=MY_ROLLOUT_KEY"])
    assert "the-users-key" not in repr(config)  # the config names the variable, never the key
    monkeypatch.setenv("MY_ROLLOUT_KEY", "-starts-like-an-option")
    with pytest.raises(ConfigError, match=r"api_key_env=MY_ROLLOUT_KEY: the key starts with '-'"):
        load_and_validate(None, [*base, "actor_rollout_ref.rollout.api_key_env=MY_ROLLOUT_KEY"])
    monkeypatch.delenv("MY_ROLLOUT_KEY")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.api_key_env=MY_ROLLOUT_KEY: that environment "
                                          r"variable is not set"):
        load_and_validate(None, [*base, "actor_rollout_ref.rollout.api_key_env=MY_ROLLOUT_KEY"])
    with pytest.raises(KeyError, match="api_key_env=MY_ROLLOUT_KEY"):
        rollout_api_key("MY_ROLLOUT_KEY")


class HealthServer:
    """An HTTP server on loopback whose `/health` answers `status` (a stand-in for a rollout
    server's HTTP process: only the probe's answer matters here)."""

    def __init__(self, status: int):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N805
                handler.send_response(status if handler.path == "/health" else 404)
                handler.end_headers()

            def log_message(handler, *args):  # noqa: N805
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class StatusWorkers:
    """The fleet's workers, recording each `status` round (each worker process reported running)."""

    def __init__(self, urls: list[str], answers: list[bool]):
        self.urls, self.answers, self.rounds = urls, answers, 0

    def call(self, method, *args, timeout_s: float):
        assert method is RolloutWorker.status
        self.rounds += 1
        return [{"url": u, "running": True, "answers": a} for u, a in zip(self.urls, self.answers)]


def test_servers_that_all_answer_health_to_the_driver_cost_no_call_to_their_workers():
    """Issue 50: the liveness check before every generation and push is one `/health` call per
    server from the driver; the workers are asked (their own probe, HUNG_AFTER_S) only when a
    server does not answer 200 at once, or a server spans nodes (whose other nodes serve no HTTP)."""
    healthy, broken = HealthServer(200), HealthServer(503)
    try:
        fleet = RolloutFleet.__new__(RolloutFleet)
        fleet.api_key, fleet.server_of = None, [0, 1]
        fleet.members = [[0], [1]]
        fleet.urls = [healthy.url, healthy.url]
        fleet.workers = StatusWorkers(fleet.urls, [True, True])
        assert fleet._failed_servers() == ({}, []) and fleet.dead_servers() == []
        assert fleet.workers.rounds == 0
        fleet.urls = [healthy.url, broken.url]  # server 1 answers 503: its worker decides
        fleet.workers = StatusWorkers(fleet.urls, [True, False])
        assert fleet.dead_servers() == [1] and fleet.workers.rounds == 1
        fleet.urls, fleet.members, fleet.server_of = [healthy.url], [[0, 1]], [0, 0]  # one server on two nodes
        fleet.workers = StatusWorkers([healthy.url, ""], [True, None])
        assert fleet.dead_servers() == [] and fleet.workers.rounds == 1
    finally:
        healthy.close()
        broken.close()

