"""`RolloutServer`: a Ray actor that owns a CPU-engine process, restarts it after a crash, stops it."""
import os
import signal
import time

import pytest
import ray

from megarl.rollout.client import RolloutClient
from megarl.rollout.launch import cpu_server_command
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.ray_server import RolloutServer


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_actor_starts_restarts_and_stops_its_server(ray_local, tiny_model_dir, tmp_path, helpers):
    port = helpers.free_port()
    url = f"http://127.0.0.1:{port}"
    server = RolloutServer.options(num_cpus=0).remote(
        cpu_server_command(tiny_model_dir, port, num_threads=1), url,
        monitor_interval_s=0.5, startup_timeout_s=120, log_path=str(tmp_path / "server.log"),
    )
    try:
        assert ray.get(server.start.remote(), timeout=180) == url
        first = ray.get(server.status.remote(), timeout=30)
        assert first["running"] and first["restarts"] == 0
        os.kill(first["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = ray.get(server.status.remote(), timeout=150)
            if status["restarts"] == 1 and status["running"]:
                break
            time.sleep(0.5)
        assert status["restarts"] == 1 and status["pid"] != first["pid"]
        result = RolloutClient(url).generate([[3, 4, 5]], SamplingParams(max_new_tokens=4, n=2, ignore_eos=True))
        assert [len(s.token_ids) for s in result.samples[0]] == [4, 4]
    finally:
        ray.get(server.stop.remote(), timeout=60)
    assert not ray.get(server.status.remote(), timeout=30)["running"]
    with pytest.raises(ProcessLookupError):
        os.kill(status["pid"], 0)
