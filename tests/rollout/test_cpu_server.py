"""The CPU engine over HTTP, driven by megarl's client and admin calls: errors, auth, memory state,
abort, and both weight-update paths (disk, and a gloo broadcast from a trainer written here)."""
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
import requests
import torch
import torch.distributed as dist

from megarl.rollout.client import RolloutClient, RolloutRequestError
from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.weight_group import (
    destroy_process_group,
    dtype_name,
    init_custom_process_group,
)

KEY = "test-key"
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, helpers):
    proc = helpers.start_cpu_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "cpu-server", api_key=KEY)
    yield proc
    proc.stop(timeout_s=15)


@pytest.fixture
def control(server):
    return ServerControl(server.url, api_key=KEY)


@pytest.fixture
def client(server):
    with RolloutClient(server.url, api_key=KEY, max_retries=2, retry_backoff_s=0.1) as client:
        yield client


def assert_matches_hf(result, prompts, model, temperature, helpers):
    for prompt, samples in zip(prompts, result.samples):
        for sample in samples:
            ref = helpers.hf_logprobs(model, prompt, sample.token_ids, temperature)
            assert torch.allclose(torch.tensor(sample.logprobs), ref, atol=1e-4)


def test_api_key_guards_everything_but_health(server):
    assert requests.get(server.url + "/health", timeout=5).status_code == 200
    assert requests.get(server.url + "/model_info", timeout=5).status_code == 401
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    assert requests.post(server.url + "/generate", json=body, timeout=5).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert requests.post(server.url + "/generate", json=body, headers=wrong, timeout=5).status_code == 401


def test_model_info(control, tiny_model_dir):
    info = control.model_info()
    assert info["model_path"] == tiny_model_dir and info["is_generation"] and info["tokenizer_path"] is None
    assert control.server_info()["context_length"] == 256


def test_weights_checker_answers_sglang_checksums_of_the_loaded_checkpoint(server, tiny_model_dir):
    """/weights_checker "checksum": SGLang 0.5.23's answer shape (http_server.py check_weights,
    io_struct.py ChecksumInfo / ParallelismInfo) and, per HF tensor of the checkpoint the server
    loaded, SGLang's CPU hash (mm_utils.tensor_hash: first 8 bytes of sha256, big-endian, 16 hex
    digits) computed here from the safetensors file; an unknown action is refused with HTTP 400."""
    import hashlib
    from pathlib import Path

    from safetensors.torch import load_file

    headers = {"Authorization": f"Bearer {KEY}"}
    answer = requests.post(server.url + "/weights_checker", json={"action": "checksum"}, headers=headers,
                           timeout=30).json()
    assert set(answer) == {"success", "message", "ranks", "per_engine_checksum"} and answer["success"] is True
    (rank,) = answer["ranks"]
    assert set(rank) == {"checksums", "per_gpu_checksum", "parallelism_info"}
    assert [set(p) for p in rank["parallelism_info"]] == [
        {"role", "tp_rank", "tp_size", "dp_rank", "dp_size", "pp_rank", "pp_size", "rank", "size"}]
    expected = {}
    for file in Path(tiny_model_dir).glob("*.safetensors"):
        for name, tensor in load_file(file).items():
            digest = hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).digest()
            expected[name] = digest[:8].hex()
    assert rank["checksums"] == expected  # no rotary cache, every weight, bit for bit
    overall = hashlib.sha256()
    for name in sorted(expected):
        overall.update(name.encode() + expected[name].encode())
    assert rank["per_gpu_checksum"] == overall.hexdigest()
    assert answer["per_engine_checksum"] == hashlib.sha256(overall.hexdigest().encode()).hexdigest()
    refused = requests.post(server.url + "/weights_checker", json={"action": "snapshot"}, headers=headers, timeout=30)
    assert refused.status_code == 400 and refused.json()["success"] is False


def test_generate_n_samples_with_honest_logprobs(client, tiny_hf, helpers):
    result = client.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.9, n=3))
    assert [len(s) for s in result.samples] == [3, 3, 3]
    samples = [s for g in result.samples for s in g]
    assert all(s.finish_reason in ("stop", "length") and s.weight_version == "default" for s in samples)
    assert_matches_hf(result, PROMPTS, tiny_hf, 0.9, helpers)
    m = result.metrics
    assert (m.requests, m.samples, m.retries) == (3, 9, 0)
    assert m.response_tokens == sum(len(s.token_ids) for g in result.samples for s in g) and m.tokens_per_s > 0


def test_the_client_keeps_one_session_for_its_life_and_close_ends_it(server, monkeypatch):
    """generate twice (from two threads) and agenerate from another event loop: one aiohttp
    session (counted at aiohttp's own class) and one loop thread; close() closes both."""
    made = []
    init = aiohttp.ClientSession.__init__

    def counted(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "__init__", counted)
    loops = lambda: sum(t.name == "megarl-rollout-client" for t in threading.enumerate())  # noqa: E731
    before, greedy, box = loops(), SamplingParams(max_new_tokens=4, temperature=0.0), {}
    client = RolloutClient(server.url, api_key=KEY)
    first = client.generate(PROMPTS[:1], greedy)
    thread = threading.Thread(target=lambda: box.update(result=client.generate(PROMPTS[:1], greedy)))
    thread.start()
    thread.join(60)
    third = asyncio.run(client.agenerate(PROMPTS[:1], greedy))
    answers = [r.samples[0][0].token_ids for r in (first, box["result"], third)]
    assert answers[0] and answers == [answers[0]] * 3
    assert len(made) == 1 and not made[0].closed and loops() == before + 1
    client.close()
    assert made[0].closed and loops() == before


def test_a_batch_per_server_gives_each_prompt_what_its_own_request_gives(server, client, tiny_hf, helpers, monkeypatch):
    """batch_per_server: the prompts of each of two server URLs (here the same server twice) go in one
    batched /generate each (counted at aiohttp's own method), and every prompt gets the samples its
    seeds give when sent on its own, with HF's log-probs."""
    prompts, seeds = PROMPTS + [[30, 31, 32]], [11, 22, 33, 44]
    sampling = SamplingParams(max_new_tokens=6, temperature=0.8, n=2)
    alone = client.generate(prompts, sampling, seeds=seeds)
    posts = []
    request = aiohttp.ClientSession._request

    async def counted(self, method, url, **kwargs):
        posts.append(kwargs["json"]["input_ids"])
        return await request(self, method, url, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "_request", counted)
    with RolloutClient(server.url, api_key=KEY, server_urls=[server.url] * 2, batch_per_server=True) as batched:
        together = batched.generate(prompts, sampling, seeds=seeds)
    assert posts == [[prompts[0], prompts[2]], [prompts[1], prompts[3]]]  # prompt i to server i % 2
    assert [[s.token_ids for s in g] for g in together.samples] == [[s.token_ids for s in g] for g in alone.samples]
    assert_matches_hf(together, prompts, tiny_hf, 0.8, helpers)
    assert (together.metrics.requests, together.metrics.samples) == (4, 8)  # a record per prompt


def test_a_refused_batch_names_its_prompts(server):
    with RolloutClient(server.url, api_key=KEY, server_urls=[server.url] * 2, batch_per_server=True) as client:
        with pytest.raises(RolloutRequestError, match=r"prompt 0: HTTP 400: in the batched request of prompts "
                                                      r"\[0, 2\]: prompt 1: .*longer than the model's context"):
            client.generate([[3, 4], [6, 7], [5] * 300], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="batch_per_server needs server_urls"):
        RolloutClient(server.url, batch_per_server=True)


def test_unknown_sampling_key_gets_400_not_a_crash(server):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "bogus_key": 3}}
    resp = requests.post(server.url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert resp.status_code == 400
    assert "unknown field `bogus_key`" in resp.json()["error"]["message"]
    assert ServerControl(server.url).health()


def test_client_names_the_prompt_that_is_too_long(client, server):
    prompts = [[3, 4], [5] * 300, [6, 7]]
    with pytest.raises(RolloutRequestError, match=r"prompt 1: HTTP 400: .*longer than the model's context length") as e:
        client.generate(prompts, SamplingParams(max_new_tokens=4))
    assert e.value.prompt_index == 1 and e.value.status == 400
    assert ServerControl(server.url).health()


def test_released_memory_refuses_generation_until_resumed(control, client):
    control.flush_cache()  # retries until idle: earlier tests may have left requests running
    control.release_memory_occupation()
    try:
        with pytest.raises(RolloutRequestError, match="released"):
            client.generate([[3, 4]], SamplingParams(max_new_tokens=2))
        with pytest.raises(ServerError, match="weights are released"):
            control.update_weights_from_disk("/nonexistent")
    finally:
        control.resume_memory_occupation()
    assert client.generate([[3, 4]], SamplingParams(max_new_tokens=2)).metrics.samples == 1
    control.flush_cache(wait_s=0)


def test_resuming_memory_never_released_ends_the_server_as_sglang_does(tiny_model_dir, tmp_path, helpers):
    """SGLang 0.5.23's scheduler raises KeyError on a resume of memory it never released and
    exits, and its server with it: a colocated server restarted (resident) and then resumed
    would die so. The CPU server ends the same way; the request gets no answer."""
    proc = helpers.start_cpu_server(tiny_model_dir, tmp_path, "crash")
    try:
        control = ServerControl(proc.url, timeout_s=10)
        control.release_memory_occupation(["kv_cache"])
        control.resume_memory_occupation(["kv_cache"])  # a released tag: fine
        with pytest.raises(ServerError):
            control.resume_memory_occupation(["weights"])
        deadline = time.monotonic() + 30
        while proc.is_running():
            assert time.monotonic() < deadline, "the server did not exit"
            time.sleep(0.05)
        assert proc.returncode == 1
        assert "KeyError: 'weights': resume_memory_occupation of memory that is not released" in \
            (tmp_path / "crash.log").read_text()
    finally:
        proc.stop(timeout_s=15)


def test_abort_returns_partial_and_unsent_samples(server):
    client = RolloutClient(server.url, api_key=KEY, max_concurrency=1)
    sampling = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True, n=2)
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=client.generate(PROMPTS, sampling)))
    thread.start()
    control = ServerControl(server.url, api_key=KEY)
    while control.server_info()["internal_states"][0]["num_running_requests"] == 0:
        threading.Event().wait(0.01)
    client.abort()
    thread.join(60)
    client.close()
    result = box["result"]
    assert all(s.finish_reason == "abort" for g in result.samples for s in g)
    assert all(len(s.token_ids) < 200 for s in result.samples[0])  # stopped while running
    assert all(s.token_ids == [] for g in result.samples[1:] for s in g)  # never sent
    assert result.metrics.aborted_samples == 6


def busy(control):
    state = control.server_info()["internal_states"][0]
    return state["num_running_requests"] + state["num_waiting_requests"] > 0


def test_client_that_goes_away_has_its_requests_aborted(server, control):
    # 512 samples of 250 tokens: many seconds of work, unless the server notices the client left
    body = {"input_ids": [[3, 4, 5]] * 32, "sampling_params": {"max_new_tokens": 250, "n": 16, "ignore_eos": True}}
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5)
    gone = time.monotonic()
    while busy(control):
        assert time.monotonic() - gone < 3.0, "the server kept generating for a client that left"
        time.sleep(0.05)


def test_update_weights_from_disk(control, client, tiny_model_dir, tmp_path, helpers):
    new_dir = helpers.make_tiny_model(tmp_path / "step1", seed=1)
    new_model = helpers.load_hf(new_dir)
    control.update_weights_from_disk(new_dir, weight_version="1")
    assert control.weight_version() == "1"
    result = client.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
    assert_matches_hf(result, PROMPTS, new_model, 1.0, helpers)
    assert {s.weight_version for g in result.samples for s in g} == {"1"}

    with pytest.raises(ServerError, match="HTTP 400: Failed to load weights from /nonexistent"):
        control.update_weights_from_disk("/nonexistent")
    assert_matches_hf(client.generate(PROMPTS, SamplingParams(max_new_tokens=4)), PROMPTS, new_model, 1.0, helpers)
    control.update_weights_from_disk(tiny_model_dir, weight_version="default")  # back for the other tests


def broadcast_flat(tensors, group):
    """Trainer side of load_format='flattened_bucket': one uint8 broadcast of the concatenated bytes."""
    dist.broadcast(torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors]), src=0, group=group)


def broadcast_each(tensors, group):
    """Trainer side of load_format=None: one broadcast per tensor, in request order."""
    for t in tensors:
        dist.broadcast(t.contiguous(), src=0, group=group)


def test_update_weights_from_distributed_over_gloo(control, client, tiny_model_dir, tmp_path, helpers):
    new_model = helpers.load_hf(helpers.make_tiny_model(tmp_path / "step2", seed=2))
    named = [(n, p.detach().to(torch.bfloat16 if "mlp" in n else torch.float32))
             for n, p in new_model.state_dict().items()]
    buckets = [(named[:10], "flattened_bucket"), (named[10:], None)]
    port = helpers.free_port("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(control.init_weights_update_group, "127.0.0.1", port, 1, 2, "wg", "gloo")
        group = init_custom_process_group("gloo", "127.0.0.1", port, rank=0, world_size=2, group_name="wg",
                                          timeout_s=60)
        joined.result(timeout=60)
        try:
            with pytest.raises(ServerError, match="between begin_weight_update"):
                control.update_weights_from_distributed(["lm_head.weight"], ["float32"], [[128, 64]], group_name="wg")
            control.begin_weight_update()
            for bucket, load_format in buckets:
                names = [n for n, _ in bucket]
                dtypes = [dtype_name(t.dtype) for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                call = pool.submit(control.update_weights_from_distributed, names, dtypes, shapes, "wg",
                                   load_format, "2")
                (broadcast_flat if load_format else broadcast_each)([t for _, t in bucket], group)
                call.result(timeout=60)
            control.end_weight_update()
        finally:
            destroy_process_group(group)
            control.destroy_weights_update_group("wg")
    # the served weights are the bf16-rounded MLP and exact other tensors of `new_model`
    sent = dict(named)
    reference = helpers.load_hf(tiny_model_dir)
    reference.load_state_dict({n: t.float() for n, t in sent.items()})
    result = client.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
    assert_matches_hf(result, PROMPTS, reference, 1.0, helpers)
    assert control.weight_version() == "2"
    control.update_weights_from_disk(tiny_model_dir, weight_version="default")


def shm_file(tensor):
    """The /dev/shm path of a CPU tensor shared by file name (torch's `file_system` strategy)."""
    _, name, _ = tensor.untyped_storage()._share_filename_cpu_()
    return "/dev/shm" + (name.decode() if isinstance(name, bytes) else name)


@pytest.fixture
def sync_control(server):
    from megarl.sync.servers import SyncServer

    return SyncServer(server.url, api_key=KEY)


def test_update_weights_from_tensor_with_shared_cpu_tensors(sync_control, client, tiny_model_dir, tmp_path, helpers):
    """SGLang 0.5.23's request: one base64 payload per TP rank, load_format null = (name, tensor)
    pairs; only inside a begin/end session; the shared memory is gone once both sides dropped it."""
    import gc
    import os

    from megarl.rollout import tensor_payload
    from megarl.rollout.weight_group import flatten_tensors, unflatten_tensors, bucket_layout

    new_model = helpers.load_hf(helpers.make_tiny_model(tmp_path / "step3", seed=3))
    named = sorted([(n, p.detach().to(torch.bfloat16 if "mlp" in n else torch.float32))
                    for n, p in new_model.state_dict().items()], key=lambda item: -item[1].element_size())
    flat, fields = flatten_tensors(named)
    copy = tensor_payload.shared_cpu_copy(flat)
    payload = tensor_payload.serialize(unflatten_tensors(copy, bucket_layout(**fields)))
    path = shm_file(copy)
    assert os.path.exists(path)

    with pytest.raises(ServerError, match="between begin_weight_update"):
        sync_control.update_weights_from_tensor([payload])
    sync_control.begin_weight_update()
    try:
        with pytest.raises(ServerError, match="TP size 1 and needs one per TP rank"):
            sync_control.update_weights_from_tensor([payload, payload])
        sync_control.update_weights_from_tensor([payload], load_format=None, weight_version="3")
    finally:
        sync_control.end_weight_update()
    del copy, payload
    gc.collect()
    assert not os.path.exists(path)  # the server dropped its view after loading, the sender its copy

    reference = helpers.load_hf(tiny_model_dir)
    reference.load_state_dict({n: t.float() for n, t in named})
    result = client.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0))
    assert_matches_hf(result, PROMPTS, reference, 1.0, helpers)
    assert sync_control.weight_version() == "3"
    sync_control.update_weights_from_disk(tiny_model_dir, weight_version="default")


def test_update_weights_from_tensor_refuses_bad_payloads(sync_control, server):
    """Garbage, a forbidden pickle global and a wrong shape are refused with 400, naming the server;
    the weights stay as they were."""
    import base64
    import pickle

    from megarl.rollout import tensor_payload

    evil = base64.b64encode(pickle.dumps([("x", __import__("os").getpid)])).decode()  # a callable global
    held = torch.zeros(3, 3)  # the sender holds what it shares until the server answered
    wrong_shape = tensor_payload.serialize([("lm_head.weight", held)])
    sync_control.begin_weight_update()
    try:
        for entry, message in [("%%%not base64", "not valid base64"), (evil, "not allowed in a weight payload"),
                               (wrong_shape, "has shape")]:
            with pytest.raises(ServerError, match=message) as info:
                sync_control.update_weights_from_tensor([entry])
            assert server.url in str(info.value) and "HTTP 400" in str(info.value)
        with pytest.raises(ServerError, match="load_format 'safetensors' is not supported"):
            sync_control.update_weights_from_tensor([wrong_shape], load_format="safetensors")
    finally:
        sync_control.end_weight_update()
    assert sync_control.weight_version() == "default"
