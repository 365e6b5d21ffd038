"""Shared fixtures: the tiny character-level model, one CPU rollout server (stopped by PID), and a
rollout backend that keeps every sample the server returned."""
import pytest
from transformers import AutoTokenizer

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.client import RolloutClient
from megarl.rollout.launch import cpu_server_command
from megarl.rollout.process import ServerProcess, start_on_a_free_port


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_model("qwen2", tmp_path_factory.mktemp("agents-tiny")))


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="session")
def cpu_server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("agents-server") / "server.log"
    proc = start_on_a_free_port(
        lambda port: ServerProcess("agents-cpu", cpu_server_command(tiny_dir, port, num_threads=1),
                                   f"http://127.0.0.1:{port}", log_path=str(log), startup_timeout_s=120),
        "127.0.0.1")
    yield proc
    proc.stop()


class SpyBackend:
    """The endpoint's `generate`: the real rollout client, keeping (prompt ids, SamplingParams, Sample) of every call."""

    def __init__(self, url):
        self.client = RolloutClient(url, max_retries=1)
        self.calls = []

    async def __call__(self, prompt_ids, sampling):
        sample = (await self.client.agenerate([prompt_ids], sampling)).samples[0][0]
        self.calls.append((list(prompt_ids), sampling, sample))
        return sample


@pytest.fixture
def spy(cpu_server):
    backend = SpyBackend(cpu_server.url)
    yield backend
    backend.client.close()
