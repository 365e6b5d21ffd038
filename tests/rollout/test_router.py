"""Two CPU-engine servers behind the real sglang-router: routing, worker registration, and a server
killed mid-batch that is restarted while the client retries its requests, losing nothing."""
import os
import signal
import socket
import threading

import pytest
import torch

from megarl.rollout.client import RolloutClient
from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.process import ProcessMonitor, start_on_a_free_port
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.router import Router

KEY = "router-test-key"  # the workers and the router share it
PROMPTS = [[3 + i, 4 + i, 5 + (i % 7)] * (1 + i % 3) for i in range(8)]


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory, helpers):
    logs = tmp_path_factory.mktemp("router-logs")
    procs = []
    try:
        for name in ("worker-a", "worker-b"):
            procs.append(helpers.start_cpu_server(tiny_model_dir, logs, name, api_key=KEY))
        yield procs
    finally:
        for proc in procs:
            proc.stop(timeout_s=15)


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory, helpers):
    # Retries are left to the client here, so that the test sees the client's retry path work.
    r = Router([s.url for s in servers], helpers.free_port("127.0.0.1"), prometheus_port=helpers.free_port("127.0.0.1"),
               api_key=KEY, disable_retries=True, health_check_interval_s=1,
               log_path=str(tmp_path_factory.mktemp("router") / "router.log"))
    r.start(timeout_s=60)
    yield r
    r.stop(timeout_s=15)


def finished_requests(server):
    return ServerControl(server.url, api_key=KEY).server_info()["internal_states"][0]["num_finished_requests"]


def test_a_router_whose_port_was_taken_starts_again_on_other_ports(servers, tmp_path, helpers):
    """The rollout fleet's router start (`start_on_a_free_port` over `Router`): its first port is one
    another process listens on, and sglang-router's log says so ("Address already in use (os error
    98)"); it starts again on new ports and registers its workers. A start that fails for another
    reason (a worker that never becomes healthy) is not retried, and leaves no router running."""
    ports, log = [], tmp_path / "router.log"

    def router_on(port, workers=tuple(s.url for s in servers)):
        ports.append(port if ports else taken.getsockname()[1])
        return Router(list(workers), ports[-1], prometheus_port=helpers.free_port("127.0.0.1"), api_key=KEY,
                      log_path=str(log), ready_timeout_s=60)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        router = start_on_a_free_port(router_on, "127.0.0.1")
    try:
        assert len(ports) == 2 and ports[0] != ports[1] and router.url == f"http://127.0.0.1:{ports[1]}"
        assert sorted(router.worker_urls(healthy_only=True)) == sorted(s.url for s in servers)
    finally:
        router.stop(timeout_s=15)
    assert "address already in use" in log.read_text().lower()

    ports.clear()
    nobody = f"http://127.0.0.1:{helpers.free_port('127.0.0.1')}"  # no server listens there
    with pytest.raises(ServerError, match="timed out after 3 s waiting for all initial workers healthy"):
        start_on_a_free_port(lambda port: Router([nobody], ports.append(port) or port,
                                                 prometheus_port=helpers.free_port("127.0.0.1"),
                                                 log_path=str(tmp_path / "nobody.log"), ready_timeout_s=3),
                             "127.0.0.1")
    assert len(ports) == 1
    with pytest.raises(OSError):  # the router that did not start was stopped
        socket.create_connection(("127.0.0.1", ports[0]), timeout=5).close()


def test_router_spreads_a_batch_and_logprobs_match_hf(router, servers, tiny_hf, helpers):
    before = [finished_requests(s) for s in servers]
    with RolloutClient(router.url, api_key=KEY, abort_urls=router.worker_urls()) as client:
        result = client.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, n=4))
    assert [len(samples) for samples in result.samples] == [4] * len(PROMPTS)
    for prompt, samples in zip(PROMPTS, result.samples):
        for sample in samples:
            ref = helpers.hf_logprobs(tiny_hf, prompt, sample.token_ids, 0.8)
            assert torch.allclose(torch.tensor(sample.logprobs), ref, atol=1e-4)
    served = [finished_requests(s) - b for s, b in zip(servers, before)]
    assert sum(served) == 4 * len(PROMPTS) and min(served) > 0, served


def test_deregistered_worker_gets_no_traffic_until_added_back(router, servers):
    a, b = servers
    router.remove_worker(a.url)
    try:
        assert router.worker_urls() == [b.url]
        before = finished_requests(a)
        with RolloutClient(router.url, api_key=KEY) as client:
            client.generate(PROMPTS, SamplingParams(max_new_tokens=3))
        assert finished_requests(a) == before
    finally:
        router.add_worker(a.url)
    assert sorted(router.worker_urls(healthy_only=True)) == sorted(s.url for s in servers)


def test_killed_server_is_restarted_and_nothing_is_lost(router, servers):
    a, _ = servers
    monitor = ProcessMonitor(servers, interval_s=0.5).start()
    client = RolloutClient(router.url, api_key=KEY, max_concurrency=4, max_retries=10, retry_backoff_s=0.3,
                           max_backoff_s=3)
    prompts = PROMPTS * 3
    sampling = SamplingParams(max_new_tokens=150, temperature=1.0, ignore_eos=True, n=2)
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=client.generate(prompts, sampling)))
    try:
        thread.start()
        control = ServerControl(a.url, api_key=KEY)
        while control.server_info()["internal_states"][0]["num_running_requests"] == 0:
            threading.Event().wait(0.01)
        os.kill(a.pid, signal.SIGKILL)  # mid-batch: worker-a has requests running
        thread.join(180)
        assert not thread.is_alive(), "rollout did not finish"
    finally:
        monitor.stop()
        client.close()
    result = box["result"]
    assert a.restarts == 1 and a.is_running() and control.health()
    assert [len(samples) for samples in result.samples] == [2] * len(prompts)  # each prompt: n, exactly once
    assert all(s.finish_reason == "length" and len(s.token_ids) == len(s.logprobs) == 150
               for samples in result.samples for s in samples)
    assert result.metrics.retried_requests >= 1 and result.metrics.aborted_samples == 0
    router._wait_for(lambda urls: a.url in urls, 30, "restarted worker healthy again")
