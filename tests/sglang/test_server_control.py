"""megarl's control of one real SGLang 0.5.23 server (float32, on the CPU) started with the run's API
key: `ServerControl` / `SyncServer` calls, `RolloutClient` generation, memory release and resume by
tag, partial rollouts across a pause and a push, aborting, and `ServerProcess` killing and
restarting it. The oracles: HF transformers' float32 log-probs of the checkpoint the server holds,
SGLang's own answers (its status codes, its log, its memory tag names).
"""
import ast
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
import torch

from real_sglang import hf_logprobs, load_hf, logprob_error, make_model, sglang_python, start_sglang

from megarl.placement.colocated_memory import AFTER_PUSH, TAGS
from megarl.rollout.client import RolloutClient, RolloutRequestError
from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.protocol import SamplingParams
from megarl.sync.servers import SyncServer

pytestmark = pytest.mark.slow  # a real SGLang server started twice (20-35 s each)

KEY = "4f6e1c2a9b7d3e5f"  # the run's API key (hex, as `launch.rollout_api_key` makes them)
TOLERANCE = 1e-4  # float32 SGLang vs HF float32
PROMPTS = [[1, 10, 11, 12], [1, 20, 5, 30, 7], [1, 40, 41]]
LONG = 24  # response tokens of the samples a pause or an abort cuts
SLOW_FORWARD_S = 0.25  # /slow_down: each forward sleeps this long (a sample >= 6 s), so a pause lands mid-sample


@pytest.fixture(scope="module")
def checkpoints(qwen2_dir, tmp_path_factory):
    """A: the server's at start; B: other weights of the same architecture (the pushes' target)."""
    return {"A": qwen2_dir, "B": make_model("qwen2", tmp_path_factory.mktemp("control-B"), seed=1)}


@pytest.fixture(scope="module")
def hf(checkpoints):
    return {name: load_hf(path) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def server(qwen2_dir, tmp_path_factory):
    server = start_sglang(qwen2_dir, tmp_path_factory.mktemp("sglang-logs"), name="sglang-keyed", api_key=KEY)
    yield server
    server.stop()


@pytest.fixture
def control(server):
    return SyncServer(server.url, KEY, timeout_s=60)


def greedy(url, prompts=PROMPTS, max_new_tokens=6, **client_args):
    """Each prompt's greedy sample, through `RolloutClient` with the key."""
    with RolloutClient(url, api_key=KEY, max_retries=0, **client_args) as client:
        result = client.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                                                         ignore_eos=True))
    return [samples[0] for samples in result.samples]


def max_diff(hf_model, samples, prompts=PROMPTS) -> float:
    """The largest |server log-prob - HF log-prob| over every token of `samples`."""
    return max(logprob_error(hf_model, p, s.token_ids, s.logprobs) for p, s in zip(prompts, samples))


def slow_down(url, seconds) -> None:
    """SGLang's test endpoint /slow_down: every forward sleeps `seconds` (None: no more)."""
    resp = requests.post(url + "/slow_down", json={"forward_sleep_time": seconds},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert resp.status_code == 200, resp.text


def wait_for_log(path, offset: int, done, timeout_s: float, poll_s: float = 0.05) -> None:
    """Poll the log file `path` from byte `offset` until `done(text since offset)`; TimeoutError after
    `timeout_s` (a server's own log says what it is doing: SGLang logs each prefill batch and, under
    `/slow_down`, each forward)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        if done(text):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: not seen within {timeout_s:.0f} s; the log since then:\n{text[-2000:]}")
        time.sleep(poll_s)


def decoding(prompts: int, steps: int):
    """A predicate on SGLang's log: `prompts` requests were prefilled ("Prefill batch, #new-seq: n")
    and `steps` more forwards ran after that (under /slow_down it logs "Scheduler.run_batch sleep"
    for each), so every request holds some tokens and still decodes."""

    def done(text: str) -> bool:
        lines, prefilled = text.splitlines(), 0
        for i, line in enumerate(lines):
            found = re.search(r"Prefill batch, #new-seq: (\d+)", line)
            prefilled += int(found.group(1)) if found else 0
            if prefilled >= prompts:
                return sum("Scheduler.run_batch sleep" in later for later in lines[i + 1:]) >= steps
        return False

    return done


def generate_in_background(client: RolloutClient, prompts) -> tuple[threading.Thread, dict]:
    """`client.generate` of LONG greedy tokens per prompt on a thread; the box gets its "result" or "error"."""
    box: dict = {}

    def run():
        try:
            box["result"] = client.generate(prompts, SamplingParams(max_new_tokens=LONG, temperature=0.0,
                                                                    ignore_eos=True))
        except Exception as e:  # the test shows it
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


# ------------------------------------------------------------------------------------------- API key
REFUSED_CALLS = {  # every call megarl makes on a server, as megarl makes it
    "model_info": lambda s: s.model_info(),
    "server_info": lambda s: s.server_info(),
    "weight_version": lambda s: s.weight_version(),
    "flush_cache": lambda s: s.flush_cache(wait_s=0),
    "abort_all": lambda s: s.abort_all(),
    "abort": lambda s: s.abort("some-request"),
    "pause_generation": lambda s: s.pause_generation("abort"),
    "continue_generation": lambda s: s.continue_generation(),
    "release_memory_occupation": lambda s: s.release_memory_occupation(),
    "resume_memory_occupation": lambda s: s.resume_memory_occupation(["weights"]),
    "begin_weight_update": lambda s: s.begin_weight_update(),
    "end_weight_update": lambda s: s.end_weight_update(),
    "init_weights_update_group": lambda s: s.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", "gloo"),
    "update_weights_from_distributed": lambda s: s.update_weights_from_distributed(["w"], ["float32"], [[1]], "g"),
    "destroy_weights_update_group": lambda s: s.destroy_weights_update_group("g"),
    "update_weights_from_tensor": lambda s: s.update_weights_from_tensor(["e30="]),
    "update_weights_from_disk": lambda s: s.update_weights_from_disk("/nonexistent"),
    "update_weight_version": lambda s: s.update_weight_version("9"),
    "weights_checksums": lambda s: s.weights_checksums(),
    "load_lora_adapter": lambda s: s.load_lora_adapter("a", "/nonexistent"),
    "load_lora_adapter_from_tensors": lambda s: s.load_lora_adapter_from_tensors({"lora_name": "a"}),
    "unload_lora_adapter": lambda s: s.unload_lora_adapter("a"),
}


@pytest.mark.parametrize("call", REFUSED_CALLS)
def test_without_the_key_every_admin_call_is_refused_401(server, call):
    with pytest.raises(ServerError, match=rf"^{re.escape(server.url)}/\S+: HTTP 401: Unauthorized"):
        REFUSED_CALLS[call](SyncServer(server.url, timeout_s=30))


def test_without_the_key_generation_is_refused_401_and_health_is_open(server):
    with RolloutClient(server.url, max_retries=0) as client, pytest.raises(RolloutRequestError) as refused:
        client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2))
    assert refused.value.status == 401 and refused.value.prompt_index == 0
    assert ServerControl(server.url).health()  # SGLang leaves /health open: megarl's start-up wait needs no key


def test_with_the_key_the_client_and_control_work(server, control, hf):
    assert control.model_info()["weight_version"] == "default"
    assert control.server_info()["tp_size"] == 1
    samples = greedy(server.url)
    assert max_diff(hf["A"], samples) < TOLERANCE
    assert all(len(s.token_ids) == 6 and s.finish_reason == "length" for s in samples)


# --------------------------------------------------------------------------------------------- memory
def sglang_memory_tags() -> list:
    """SGLang 0.5.23's own tag names: `GPU_MEMORY_ALL_TYPES` of sglang/srt/constants.py, read from the
    installed wheel's source (importing sglang takes ~13 s)."""
    where = subprocess.run([sglang_python(), "-c", "import importlib.util; "
                            "print(importlib.util.find_spec('sglang').submodule_search_locations[0])"],
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    tree = ast.parse(Path(where, "srt", "constants.py").read_text())
    names = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) for t in node.targets}
    return [ast.literal_eval(names[element.id]) for element in names["GPU_MEMORY_ALL_TYPES"].elts]


def test_megarls_memory_tags_are_sglangs():
    assert sorted(TAGS) == sorted(sglang_memory_tags())
    assert set(AFTER_PUSH) == set(TAGS) - {"weights"}


def test_release_all_then_resume_by_tag_around_a_push(server, control, checkpoints, hf):
    """The colocated cycle, as `placement.colocated_memory` orders it: release everything, resume
    the weights, push (here from disk), resume the rest, generate: the pushed weights answer. With
    no memory saver (none on a CPU) SGLang frees nothing and does not refuse generating while
    released (it checks no tag on /generate): the samples are the same as before the release."""
    control.update_weights_from_disk(checkpoints["A"], weight_version="a")
    before = greedy(server.url)
    control.release_memory_when_idle()  # tags None: all of them; once idle, as the fleet releases
    released = greedy(server.url)
    assert [s.token_ids for s in released] == [s.token_ids for s in before]
    assert max_diff(hf["A"], released) < TOLERANCE
    control.resume_memory_occupation(["weights"])
    control.update_weights_from_disk(checkpoints["B"], weight_version="b")
    control.resume_memory_occupation(list(AFTER_PUSH))
    after = greedy(server.url)
    assert max_diff(hf["B"], after) < TOLERANCE and max_diff(hf["A"], after) > 1e-2
    assert {s.weight_version for s in after} == {"b"}


def test_release_and_resume_of_each_tag_alone(server, control, checkpoints, hf):
    control.update_weights_from_disk(checkpoints["A"], weight_version="a")
    for tag in TAGS:
        control.release_memory_when_idle([tag])
        control.resume_memory_occupation([tag])
        assert max_diff(hf["A"], greedy(server.url)) < TOLERANCE, tag


# ----------------------------------------------------------------------------------- partial rollouts
def test_a_pause_aborts_samples_that_the_client_continues_after_a_push(server, control, checkpoints, hf):
    """Partial rollouts: /pause_generation (mode abort) mid-sample returns each sample's tokens so far;
    `RolloutClient(continue_aborted=True)` sends prompt + tokens again, which waits at the server while
    B is pushed and runs after /continue_generation. Every sample comes back whole, each token with
    the log-prob of the weights that chose it: HF(A)'s for the tokens before the pause, HF(B)'s after."""
    control.update_weights_from_disk(checkpoints["A"], weight_version="a")
    slow_down(server.url, SLOW_FORWARD_S)
    offset = os.path.getsize(server.log_path)
    try:
        with RolloutClient(server.url, api_key=KEY, max_retries=0, continue_aborted=True) as client:
            thread, box = generate_in_background(client, PROMPTS)
            wait_for_log(server.log_path, offset, decoding(len(PROMPTS), steps=3), timeout_s=120)
            control.pause_generation("abort")
            slow_down(server.url, None)
            control.update_weights_from_disk(checkpoints["B"], weight_version="b")
            control.continue_generation()
            thread.join(timeout=120)
    finally:
        slow_down(server.url, None)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    for prompt, (sample,) in zip(PROMPTS, box["result"].samples):
        assert len(sample.token_ids) == LONG and sample.finish_reason == "length"
        versions = sample.weight_versions
        cut = versions.index("b")  # the tokens before the pause came from A, the rest from B
        assert 3 <= cut < LONG and versions == ["a"] * cut + ["b"] * (LONG - cut)
        expected = torch.cat([hf_logprobs(hf["A"], prompt, sample.token_ids)[:cut],
                              hf_logprobs(hf["B"], prompt, sample.token_ids)[cut:]])
        assert (torch.tensor(sample.logprobs, dtype=torch.float64) - expected).abs().max() < TOLERANCE
        assert sample.weight_version == "b"


def test_the_clients_abort_returns_the_running_samples_cut_short(server, control, checkpoints, hf):
    """`RolloutClient.abort()` asks the server to abort everything (/abort_request abort_all): each
    running sample comes back with finish reason abort and the tokens it had, each with its log-prob."""
    control.update_weights_from_disk(checkpoints["A"], weight_version="a")
    slow_down(server.url, SLOW_FORWARD_S)
    offset = os.path.getsize(server.log_path)
    try:
        with RolloutClient(server.url, api_key=KEY, max_retries=0) as client:
            thread, box = generate_in_background(client, PROMPTS)
            wait_for_log(server.log_path, offset, decoding(len(PROMPTS), steps=3), timeout_s=120)
            client.abort()
            thread.join(timeout=120)
    finally:
        slow_down(server.url, None)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    for prompt, (sample,) in zip(PROMPTS, box["result"].samples):
        assert sample.finish_reason == "abort" and 3 <= len(sample.token_ids) < LONG
        assert max_diff(hf["A"], [sample], [prompt]) < TOLERANCE
    assert max_diff(hf["A"], greedy(server.url)) < TOLERANCE  # the server serves on


# ------------------------------------------------------------------------------------------- restart
def process_group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return members


def test_a_killed_server_comes_back_at_its_url(server, hf):
    """`ServerProcess.kill` SIGKILLs the server's whole process group (HTTP server, scheduler,
    detokenizer); `ensure_running` starts it again at the same URL with the same command (the key
    too), serving its checkpoint from disk (what was pushed is gone) at version "default"."""
    url, pid = server.url, server.pid
    assert len(process_group(pid)) >= 3
    server.kill("test: a server that does not answer")
    assert server.returncode == -9 and process_group(pid) == [] and not ServerControl(url).health()
    assert server.ensure_running()
    assert server.url == url and server.pid != pid and server.restarts == 1
    with pytest.raises(ServerError, match="HTTP 401"):
        ServerControl(url).model_info()
    samples = greedy(url)
    assert max_diff(hf["A"], samples) < TOLERANCE and {s.weight_version for s in samples} == {"default"}
