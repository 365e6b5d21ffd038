"""Issue 49, finding 3: the colocated release after generation, on real SGLang 0.5.23 and on
megarl's CPU engine. SGLang asserts an idle scheduler on `/release_memory_occupation`
(managers/scheduler_components/weight_updater.py) and its server exits on the AssertionError; a
server can still be busy when the trainer releases it (a request the client gave up on runs on,
a finished batch waits for the scheduler's next loop). The rollout fleet's release
(`RolloutFleet.release_memory`) waits until the server is idle (`/flush_cache`, which SGLang runs
only then) and releases; a bare release at that moment ends the server, real SGLang and the CPU
engine alike. One server of each kind for the module; the last test ends it."""
import http.client
import json
import select
import threading
import time
import urllib.parse
from typing import Optional

import pytest
import requests

from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.launch import cpu_server_command
from megarl.rollout.process import ServerProcess, log_tail, start_on_a_free_port
from megarl.runtime.rollout_fleet import RolloutFleet
from real_sglang import CONTEXT, start_sglang

TAGS = ("weights", "kv_cache", "cuda_graph")
PROMPT = [5, 6, 7, 8]
# tokens a busy server still has to generate once the test has seen it running: as many as the
# context holds (a decode step takes about 5 ms on SGLang on this CPU, 1 ms on the CPU engine)
NEW_TOKENS = CONTEXT - len(PROMPT)
SAMPLES = {"sglang": 1, "cpu": 16}


@pytest.fixture(scope="module", params=["sglang", "cpu"])
def server(request, qwen2_dir, tmp_path_factory):
    """(engine, a running server of it): real SGLang, or megarl's CPU engine, on the tiny Qwen2."""
    logs = tmp_path_factory.mktemp(f"release-{request.param}")
    if request.param == "sglang":
        proc = start_sglang(qwen2_dir, logs, name="sglang-release")
    else:
        proc = start_on_a_free_port(
            lambda port: ServerProcess("cpu-release", cpu_server_command(qwen2_dir, port, dtype="float32",
                                                                         context_length=CONTEXT, num_threads=1),
                                       f"http://127.0.0.1:{port}", log_path=str(logs / "cpu-release.log"),
                                       startup_timeout_s=120), "127.0.0.1")
    yield request.param, proc
    proc.stop()


class Generation(threading.Thread):
    """A long generation (ignore_eos) from a thread; `start_and_wait_running` returns once the
    server runs it. `answer`: its samples' answers (JSON), once done."""

    def __init__(self, engine: str, url: str, samples: Optional[int] = None):
        super().__init__(daemon=True)
        self.engine, self.url, self.answer, self.error = engine, url, None, None
        self.samples = samples or SAMPLES[engine]
        self.running = threading.Event()

    def run(self) -> None:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                                          "ignore_eos": True, "n": self.samples}}
        try:
            if self.engine == "sglang":  # streamed: its first chunk means the scheduler runs it
                with requests.post(self.url + "/generate", json={**body, "stream": True}, stream=True,
                                   timeout=300) as resp:
                    resp.raise_for_status()
                    for line in resp.iter_lines():
                        if line.startswith(b"data:") and line != b"data: [DONE]":
                            self.running.set()
                            self.answer = [json.loads(line[len(b"data:"):])]  # the last chunk: the answer
            else:
                resp = requests.post(self.url + "/generate", json=body, timeout=300)
                resp.raise_for_status()
                answer = resp.json()
                self.answer = answer if isinstance(answer, list) else [answer]
        except Exception as e:  # reported by the test
            self.error = e
        finally:
            self.running.set()

    def start_and_wait_running(self) -> None:
        self.start()
        if self.engine == "cpu":  # the CPU engine does not stream: it reports its running requests
            control = ServerControl(self.url, timeout_s=10)
            while not self.running.wait(0.005):  # ends with the generation at the latest (its timeout)
                if control.server_info()["internal_states"][0]["num_running_requests"] > 0:
                    self.running.set()
        assert self.running.wait(120), "the generation did not start"
        assert self.error is None, self.error


def fleet_over(url: str) -> RolloutFleet:
    """The rollout fleet's memory calls, over one running server (they need none of its Ray
    workers, which start and restart servers)."""
    fleet = RolloutFleet.__new__(RolloutFleet)
    fleet.urls, fleet.api_key, fleet.memory_call_timeout_s = [url], None, 120.0
    return fleet


def test_the_fleets_release_waits_until_the_server_is_idle(server):
    engine, proc = server
    generation = Generation(engine, proc.url)
    generation.start_and_wait_running()
    failed = fleet_over(proc.url).release_memory({0: TAGS})
    generation.join(300)
    assert failed == {}, f"{failed}\n{log_tail(proc.log_path, 15)}"
    assert proc.is_running() and ServerControl(proc.url).health()
    # the release waited for the generation, which ran to its end
    assert generation.error is None, generation.error
    assert [a["meta_info"]["finish_reason"]["type"] for a in generation.answer] == ["length"] * SAMPLES[engine]
    assert fleet_over(proc.url).resume_memory({0: TAGS}) == {}
    out = requests.post(proc.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
                        timeout=120)
    assert out.status_code == 200, out.text


def test_a_flush_waits_until_the_server_is_idle_and_flushes_take_turns(server):
    """SGLang 0.5.23's `/flush_cache?timeout=` (managers/scheduler_components/flush_wrapper.py,
    `SchedulerFlushWrapper`), which `ServerControl.flush_cache` uses (the release's drain, the
    push's): on a busy server a flush that may not wait is refused at once, one that may is
    answered once the server is idle (the generation ran to its end, nothing aborted); a flush
    sent while one waits waits its turn (the tokenizer manager's queueing `FanOutCommunicator`,
    managers/communicator.py) and is answered after it; a negative wait is a bad request."""
    engine, proc = server
    control = ServerControl(proc.url, timeout_s=60)
    generation = Generation(engine, proc.url)
    generation.start_and_wait_running()
    with pytest.raises(ServerError, match="/flush_cache.*: HTTP 400"):
        control.flush_cache(wait_s=0)
    # The first flush's request is on the wire (http.client sends it and returns) before the second
    # one's connection opens, so the server reads it first however loaded this machine is.
    host, port = urllib.parse.urlsplit(proc.url).hostname, urllib.parse.urlsplit(proc.url).port
    waits = http.client.HTTPConnection(host, port, timeout=300)
    waits.request("POST", "/flush_cache?timeout=120")
    time.sleep(0.2)  # margin for the server to read it (the order above is what the test relies on)
    busy = generation.is_alive()
    does_not_wait = http.client.HTTPConnection(host, port, timeout=300)
    does_not_wait.request("POST", "/flush_cache")
    # Which answer came first, as the kernel saw it (two threads appending would race): on loopback
    # an answer is in its socket once the server has sent it, so the first socket to turn readable
    # holds the first answer sent (both at once when they came too close to tell apart).
    waits_socket = waits.sock
    first_answered, _, _ = select.select([waits_socket, does_not_wait.sock], [], [], 300)
    assert first_answered, "no flush was answered within 300 s"
    statuses = (waits.getresponse().status, does_not_wait.getresponse().status)
    waits.close()
    does_not_wait.close()
    generation.join(300)
    assert busy, "the generation ended before the second flush was sent: the test saw no queue"
    assert statuses == (200, 200), statuses  # the second, on a busy server, was not refused: it waited
    assert len(first_answered) == 2 or first_answered == [waits_socket], "the second flush was answered first"
    assert generation.error is None, generation.error
    assert [a["meta_info"]["finish_reason"]["type"] for a in generation.answer] == ["length"] * SAMPLES[engine]
    assert requests.post(proc.url + "/flush_cache?timeout=-1", timeout=30).status_code == 400


def test_a_bare_release_while_the_server_is_busy_ends_it(server):
    """SGLang's rule itself (what megarl's release did before waiting): the scheduler's assertion
    ends the server. Run last: the module's server is gone after it. On SGLang 64 samples: about 7
    fit its KV cache at once and the rest queue, so the server stays busy for many seconds after it
    is seen running (one sample's 252 tokens took 1.3 s, and a bare release sent on a machine loaded
    with 5 processes on 2 cores reached the scheduler after it about one time in ten; stop 62's CI
    saw it with 48 tokens); the release ends the server, so the test does not wait for them."""
    engine, proc = server
    generation = Generation(engine, proc.url, samples=64 if engine == "sglang" else None)
    generation.start_and_wait_running()
    with pytest.raises(ServerError):
        ServerControl(proc.url, timeout_s=60).release_memory_occupation(list(TAGS))
    deadline = time.monotonic() + 60
    while proc.is_running():
        assert time.monotonic() < deadline, "the server still runs 60 s after the release"
        time.sleep(0.1)
    assert "release_memory_occupation should be called only when server is idle" in log_tail(proc.log_path, 200)
    generation.join(60)
