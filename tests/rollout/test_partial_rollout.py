"""Partial rollouts over SGLang 0.5.23's protocol against the CPU engine: `/pause_generation`
(mode abort) interrupts a running generation, the weights change while paused, and after
`/continue_generation` the client continues the sample from its tokens with the new weights.
The oracle is HF's own model: each token's rollout log-prob is that of the weights that were
loaded when it was sampled."""
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.timeout(900)

from megarl.rollout.client import RolloutClient
from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.protocol import SamplingParams

PROMPT = [5, 6, 7]
TOKENS = 240  # + the prompt: within the tiny model's 256-token context


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, helpers):
    proc = helpers.start_cpu_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "cpu-server-partial")
    yield proc
    proc.stop(timeout_s=15)


def running(control: ServerControl) -> bool:
    return control.server_info()["internal_states"][0]["num_running_requests"] > 0


def generation_s(control: ServerControl, sampling: SamplingParams) -> float:
    """Wall seconds of one uninterrupted generation of PROMPT on this machine, now."""
    start = time.monotonic()
    with RolloutClient(control.url) as client:
        client.generate([PROMPT], sampling)
    return time.monotonic() - start


def interrupted(control: ServerControl, new_dir, sampling: SamplingParams, pause_after_s: float):
    """One sample generated while, `pause_after_s` after it is seen running, the server is paused,
    given `new_dir`'s weights (version "1") and continued. Returns the sample."""
    client = RolloutClient(server_url := control.url, continue_aborted=True)
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=client.generate([PROMPT], sampling)))
    thread.start()
    deadline = time.monotonic() + 300
    while not running(control):
        assert time.monotonic() < deadline and thread.is_alive(), f"never seen running at {server_url}"
        time.sleep(0.005)
    time.sleep(pause_after_s)  # some tokens from the first weights, not all of them
    control.pause_generation("abort")
    control.update_weights_from_disk(new_dir, weight_version="1")  # allowed while paused
    time.sleep(0.3)
    assert not running(control)  # the continuation waits for /continue_generation
    control.continue_generation()
    thread.join(300)
    client.close()
    return box["result"].samples[0][0]


def test_a_paused_sample_continues_with_the_new_weights(server, tiny_model_dir, tiny_hf, helpers, tmp_path):
    control = ServerControl(server.url)
    new_dir = helpers.make_tiny_model(tmp_path / "step1", seed=1)
    sampling = SamplingParams(max_new_tokens=TOKENS, temperature=1.0, ignore_eos=True, sampling_seed=3)
    try:
        # The pause must land mid-generation on a fast quiet machine (240 tokens in well under a
        # second) and on a loaded one: pause a third of the way through a measured generation,
        # measured again before each retry (the load changes).
        for _ in range(3):
            sample = interrupted(control, new_dir, sampling, generation_s(control, sampling) / 3)
            if sample.weight_versions is not None:
                break
            control.update_weights_from_disk(tiny_model_dir, weight_version="default")
        assert sample.finish_reason == "length" and len(sample.token_ids) == TOKENS
        versions = sample.weight_versions
        assert versions is not None, "never interrupted while running: no tokens from the first weights"
        cut = versions.index("1")
        assert 0 < cut < TOKENS and versions == ["default"] * cut + ["1"] * (TOKENS - cut)
        assert sample.weight_version == "1"
        # Each token's log-prob is that of the weights that sampled it.
        old = helpers.hf_logprobs(tiny_hf, PROMPT, sample.token_ids, 1.0)
        new = helpers.hf_logprobs(helpers.load_hf(new_dir), PROMPT, sample.token_ids, 1.0)
        got = torch.tensor(sample.logprobs)
        torch.testing.assert_close(got[:cut], old[:cut], atol=1e-4, rtol=0)
        torch.testing.assert_close(got[cut:], new[cut:], atol=1e-4, rtol=0)
        assert not torch.allclose(old[cut:], new[cut:], atol=1e-2)  # the two models do differ there
    finally:
        control.update_weights_from_disk(tiny_model_dir, weight_version="default")


def test_only_the_abort_mode_is_implemented(server):
    with pytest.raises(ServerError, match="HTTP 400.*'abort' only"):
        ServerControl(server.url).pause_generation("retract")
