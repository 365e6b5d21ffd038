"""megarl's `Router` (the real sglang-router) in front of two real SGLang 0.5.23 servers (float32, on
the CPU), all three demanding the run's API key. The servers hold different weights (A, and B pushed
from disk under version "b"), so each answer says which server gave it: its log-probs are HF
transformers' of that server's checkpoint, and its `weight_version` names it.
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from real_sglang import load_hf, logprob_error, make_model, start_sglang

from megarl.net import free_port
from megarl.rollout.client import RolloutClient, RolloutRequestError
from megarl.rollout.control import ServerControl
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.router import Router

pytestmark = pytest.mark.slow  # two real SGLang servers (20-35 s to start, together on 2 cores ~50 s)

KEY = "9c1d7e3b5a2f4e6d"  # the run's API key: the servers demand it, the router demands it and sends it on
TOLERANCE = 1e-4  # float32 SGLang vs HF float32
PROMPTS = [[1, 4 + i, 10 + 2 * i, 30 - i] for i in range(8)]


@pytest.fixture(scope="module")
def checkpoints(qwen2_dir, tmp_path_factory):
    return {"a": qwen2_dir, "b": make_model("qwen2", tmp_path_factory.mktemp("router-B"), seed=1)}


@pytest.fixture(scope="module")
def hf(checkpoints):
    return {version: load_hf(path) for version, path in checkpoints.items()}


@pytest.fixture(scope="module")
def servers(qwen2_dir, checkpoints, tmp_path_factory):
    """Two servers of A; the second then serves B (version "b"), the first A under version "a"."""
    logs = tmp_path_factory.mktemp("router-sglang-logs")
    with ThreadPoolExecutor(2) as pool:
        starts = [pool.submit(start_sglang, qwen2_dir, logs, name=f"sglang-worker-{i}", api_key=KEY) for i in range(2)]
    procs = [f.result() for f in starts if f.exception() is None]
    try:
        for f in starts:
            if f.exception() is not None:
                raise f.exception()
        for proc, version in zip(procs, ("a", "b")):
            ServerControl(proc.url, KEY).update_weights_from_disk(checkpoints[version], weight_version=version)
        yield procs
    finally:
        with ThreadPoolExecutor(2) as pool:  # each takes a few seconds to exit
            list(pool.map(lambda proc: proc.stop(), procs))


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    r = Router([s.url for s in servers], free_port("127.0.0.1"), prometheus_port=free_port("127.0.0.1"), api_key=KEY,
               health_check_interval_s=1, log_path=str(tmp_path_factory.mktemp("router") / "router.log"))
    r.start(timeout_s=60)
    yield r
    r.stop()


def answers_by_version(router, hf) -> dict:
    """Greedy samples of PROMPTS through the router, grouped by the version (server) that answered;
    every one checked against HF's log-probs of that server's checkpoint."""
    with RolloutClient(router.url, api_key=KEY, max_retries=0, abort_urls=router.worker_urls()) as client:
        result = client.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    by_version: dict = {}
    for prompt, (sample,) in zip(PROMPTS, result.samples):
        assert logprob_error(hf[sample.weight_version], prompt, sample.token_ids, sample.logprobs) < TOLERANCE
        by_version.setdefault(sample.weight_version, []).append(prompt)
    return by_version


def test_the_router_spreads_requests_over_both_servers(router, servers, hf):
    assert sorted(router.worker_urls(healthy_only=True)) == sorted(s.url for s in servers)
    by_version = answers_by_version(router, hf)
    assert sorted(by_version) == ["a", "b"]  # round robin: both servers answered
    assert sum(len(p) for p in by_version.values()) == len(PROMPTS)


def test_a_removed_worker_gets_nothing_until_it_is_added_back(router, servers, hf):
    a, b = servers
    router.remove_worker(b.url)
    try:
        assert router.worker_urls() == [a.url]
        assert sorted(answers_by_version(router, hf)) == ["a"]
    finally:
        router.add_worker(b.url)
    assert sorted(router.worker_urls(healthy_only=True)) == sorted(s.url for s in servers)
    assert sorted(answers_by_version(router, hf)) == ["a", "b"]


def test_the_router_refuses_a_client_without_the_key(router):
    with RolloutClient(router.url, max_retries=0) as client, pytest.raises(RolloutRequestError) as refused:
        client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    assert refused.value.status == 401
