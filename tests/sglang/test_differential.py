"""megarl's CPU engine held to real SGLang 0.5.23 (issue 49): the same requests go to an SGLang server
and to the CPU engine, both serving the tiny Qwen2 in float32 behind the same API key, and must get
the same answers or the same refusals; log-probs are also checked against the HF model itself.

What SGLang computes, read in its source (sglang/srt/) and checked here:
- output log-probs: of the sampled token under softmax(logits / T) (`layers/sampler.py::Sampler.forward`:
  `logits.div_(temperatures)`, then `torch.log(probs)` of the unfiltered probabilities), under
  log_softmax(logits) when the whole batch is greedy; `SGLANG_RETURN_ORIGINAL_LOGPROB` (off by
  default, pinned off here) would give T = 1 for all;
- input log-probs: log_softmax(logits), no temperature (`layers/logprob_processor.py::InputLogprobProcessor`);
- input entries name ids from vocab_size - 1 up as 0, output entries do not
  (`managers/scheduler_components/logprob_result_processor.py::_process_input_token_logprobs`).

One server of each kind for the module, started together (SGLang takes 20-35 s on an idle 2-core
machine). The last test ends both servers.
"""
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM

from megarl.rollout import tensor_payload
from megarl.rollout.control import ServerControl
from real_sglang import start_cpu_engine, start_sglang

pytestmark = pytest.mark.slow

KEY = "differential-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
KINDS = ("sglang", "cpu")
VOCAB_END = 46  # vocab_size - 1 of the 47-token character vocabulary
SGLANG_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}  # its default, whatever the caller's environment says
ATOL = 1e-4  # float32: SGLang's torch-native attention and the CPU engine's HF forward against one HF forward


@pytest.fixture(scope="module")
def servers(qwen2_dir, tmp_path_factory):
    """{"sglang": real SGLang, "cpu": megarl's CPU engine}, both with the API key KEY, started together."""
    logs = tmp_path_factory.mktemp("differential-logs")
    with ThreadPoolExecutor(2) as pool:
        starting = {"sglang": pool.submit(start_sglang, qwen2_dir, logs, api_key=KEY, env=SGLANG_ENV),
                    "cpu": pool.submit(start_cpu_engine, qwen2_dir, logs, api_key=KEY)}
    started = {kind: f.result() for kind, f in starting.items() if f.exception() is None}
    try:
        for f in starting.values():
            f.result()  # raises the first start that failed
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def hf(qwen2_dir):
    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


def hf_log_probs(hf, ids, temperature=1.0):
    """[len(ids) - 1]: log p(ids[t] | ids[:t]) under softmax(logits / T) for t >= 1, one HF forward."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def prompt(hf):
    """<bos> "+12" then two characters, one of them the vocabulary's last id (46), chosen so that the HF
    model's greedy next token is 46 as well, by the widest margin over the runner-up."""
    candidates = [[1, 14, 5, 6, a, b] for a in range(4, 47) for b in range(4, 47) if VOCAB_END in (a, b)]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor(candidates)).logits[:, -1]
    top2 = logits.topk(2, dim=-1)
    margin = torch.where(top2.indices[:, 0] == VOCAB_END, top2.values[:, 0] - top2.values[:, 1], -1.0)
    best = int(margin.argmax())
    if margin[best] <= 0:
        pytest.fail("no candidate prompt makes the tiny model's greedy next token the vocabulary's last id")
    return candidates[best]


def ask(server, method, path, body=None, headers=AUTH, timeout_s=60.0):
    """(status, the JSON body or, if it is not JSON, the text) of one request."""
    resp = requests.request(method, server.url + path, json=body, headers=headers, timeout=timeout_s)
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, resp.text


def both(servers, method, path, body=None, **kwargs):
    return {kind: ask(servers[kind], method, path, body, **kwargs) for kind in KINDS}


def wait_idle(servers):
    """Both servers idle, as a release needs (`ServerControl.flush_cache` retries until SGLang flushes,
    which it does only when fully idle): a release right after a generation can find the scheduler
    still holding the finished batch, and SGLang's idle assertion then ends the server (finding 3)."""
    for kind in KINDS:
        ServerControl(servers[kind].url, KEY, timeout_s=60).flush_cache()


def assert_same(answers):
    assert answers["cpu"] == answers["sglang"]
    return answers["sglang"]


def generated(servers, body):
    """Both servers' /generate answers, each required to be a 200."""
    answers = both(servers, "POST", "/generate", body)
    for kind, (status, out) in answers.items():
        assert status == 200, (kind, out)
    return {kind: out for kind, (_, out) in answers.items()}


def assert_log_probs(entries, expected, kind):
    """The log-probs of [logprob, id, text] `entries` are `expected` [len(entries)] within ATOL."""
    torch.testing.assert_close(torch.tensor([e[0] for e in entries]), expected, atol=ATOL, rtol=0,
                               msg=lambda message: f"{kind}: {message}")


def entry_id(token_id):
    """SGLang's id in an input entry: `x if x < vocab_size - 1 else 0`."""
    return token_id if token_id < VOCAB_END else 0


@pytest.mark.parametrize("start", [0, 3])
def test_greedy_tokens_and_log_probs(servers, hf, prompt, start):
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 6},
            "return_logprob": True, "logprob_start_len": start}
    outputs = generated(servers, body)
    ids = outputs["sglang"]["output_ids"]
    assert outputs["cpu"]["output_ids"] == ids and ids[0] == VOCAB_END
    oracle = hf_log_probs(hf, prompt + ids)  # greedy: log_softmax(logits)
    for kind, out in outputs.items():
        meta = out["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == ids, kind  # 46 stays 46 in output entries
        assert_log_probs(meta["output_token_logprobs"], oracle[len(prompt) - 1:], kind)
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == [entry_id(t) for t in prompt[start:]], kind
        assert entries[0][0] is None and all(e[2] is None for e in entries), kind
        assert_log_probs(entries[1:], oracle[start:len(prompt) - 1], kind)


def test_sampled_output_log_probs_are_at_the_temperature_and_input_ones_are_not(servers, hf, prompt):
    temperature = 0.7
    body = {"input_ids": prompt, "sampling_params": {"temperature": temperature, "max_new_tokens": 6},
            "return_logprob": True, "logprob_start_len": 0}
    plain = hf_log_probs(hf, prompt)
    # the check can tell the two apart: the prompt's log-probs at T = 0.7 are others
    assert (hf_log_probs(hf, prompt, temperature) - plain).abs().max() > 1e-2
    for kind, out in generated(servers, body).items():
        ids, meta = out["output_ids"], out["meta_info"]
        at_t = hf_log_probs(hf, prompt + ids, temperature)[len(prompt) - 1:]
        assert_log_probs(meta["output_token_logprobs"], at_t, kind)
        assert_log_probs(meta["input_token_logprobs"][1:], plain, kind)


def test_the_meta_info_megarl_reads(servers, prompt):
    base = {"input_ids": prompt, "return_logprob": True}
    # a stop token (the first greedy one, 46): matched as an int, left out of the text
    stop = generated(servers, {**base, "sampling_params": {"temperature": 0, "max_new_tokens": 4,
                                                           "stop_token_ids": [VOCAB_END]}})
    # the length limit; no logprob_start_len: no input entries
    length = generated(servers, {**base, "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
    for outputs, finish in [(stop, {"type": "stop", "matched": VOCAB_END}), (length, {"type": "length", "length": 3})]:
        for kind, out in outputs.items():
            meta = out["meta_info"]
            assert meta["finish_reason"] == finish, kind
            assert meta["prompt_tokens"] == len(prompt) and meta["completion_tokens"] == len(out["output_ids"]), kind
            assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) and meta["input_token_logprobs"] == []
        assert outputs["cpu"]["output_ids"] == outputs["sglang"]["output_ids"]
        assert outputs["cpu"]["text"] == outputs["sglang"]["text"]
        assert outputs["cpu"]["meta_info"]["weight_version"] == outputs["sglang"]["meta_info"]["weight_version"]
    assert stop["sglang"]["output_ids"] == [VOCAB_END] and stop["sglang"]["text"] == ""
    # a start at the prompt's length: no entries; past it: refused
    at_end = generated(servers, {**base, "logprob_start_len": len(prompt), "sampling_params": {"max_new_tokens": 1}})
    assert [out["meta_info"]["input_token_logprobs"] for out in at_end.values()] == [[], []]
    past = both(servers, "POST", "/generate", {**base, "logprob_start_len": len(prompt) + 1})
    for kind, (status, body) in past.items():
        assert status == 400 and "is higher than the number of input tokens" in body["error"]["message"], kind
    # a batch answers with a list, in order
    batch = generated(servers, {"input_ids": [prompt, prompt[:3]], "sampling_params": {"temperature": 0,
                                                                                       "max_new_tokens": 2}})
    assert [o["output_ids"] for o in batch["cpu"]] == [o["output_ids"] for o in batch["sglang"]]
    # the batch megarl's client sends the CPU engine (rollout.batch_requests_per_server): a sampling_params
    # per prompt, n > 1; prompt-major answers (`managers/tokenizer_manager.py::_handle_batch_request`),
    # each prompt under its own parameters
    params = [{"temperature": 0, "max_new_tokens": 2, "n": 2, "ignore_eos": True},
              {"temperature": 0, "max_new_tokens": 3, "n": 2, "ignore_eos": True}]
    batch = generated(servers, {"input_ids": [prompt, prompt[:3]], "sampling_params": params, "return_logprob": True})
    for kind, out in batch.items():
        assert [len(o["output_ids"]) for o in out] == [2, 2, 3, 3], kind
        assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in out), kind
    assert [o["output_ids"] for o in batch["cpu"]] == [o["output_ids"] for o in batch["sglang"]]


def hf_top_k(hf, ids, k):
    """([len(ids), k] log-probs, [len(ids), k] ids): HF's top k of log_softmax(logits) at each position."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).topk(k, dim=-1)


@pytest.mark.parametrize("start", [0, 3])
def test_input_top_logprobs_are_sglangs(servers, hf, prompt, start):
    """`top_logprobs_num` k with max_new_tokens 0 (what an SGLang teacher's `score_top_k` sends):
    `input_top_logprobs` null first, then per position k [logprob, id, null] entries, descending, the
    ids unclipped (46 stays 46); `output_top_logprobs` one row, the top k after the whole input; the
    values HF's top k of log_softmax(logits). A top_logprobs_num that is no int is refused by both."""
    k = 5
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": start, "top_logprobs_num": k}
    outputs = generated(servers, body)
    values, ids = hf_top_k(hf, prompt, k)
    metas = {kind: out["meta_info"] for kind, out in outputs.items()}
    assert ids[-1, 0] == VOCAB_END  # the unclipped id is exercised (the prompt fixture's greedy next token)
    for kind, meta in metas.items():
        rows = meta["input_top_logprobs"]
        assert len(rows) == len(prompt) - start and rows[0] is None, kind
        assert all(len(row) == k and all(e[2] is None for e in row) for row in rows[1:]), kind
        # row t (t >= 1) is the distribution of prompt[start + t], HF's row start + t - 1
        assert [[e[1] for e in row] for row in rows[1:]] == ids[start:-1].tolist(), kind
        torch.testing.assert_close(torch.tensor([[e[0] for e in row] for row in rows[1:]]), values[start:-1],
                                   atol=ATOL, rtol=0, msg=lambda m: f"{kind}: {m}")
        (after,) = meta["output_top_logprobs"]
        assert [e[1] for e in after] == ids[-1].tolist(), kind
        torch.testing.assert_close(torch.tensor([e[0] for e in after]), values[-1], atol=ATOL, rtol=0,
                                   msg=lambda m: f"{kind}: {m}")
        assert meta["output_token_logprobs"] == [] and len(meta["input_token_logprobs"]) == len(rows), kind
    # none asked (0 or below): no top entries at all; at the input's end: none, and no leading null
    for num in (0, -1):
        for kind, out in generated(servers, {**body, "top_logprobs_num": num}).items():
            assert "input_top_logprobs" not in out["meta_info"], (kind, num)
    at_end = generated(servers, {**body, "logprob_start_len": len(prompt)})
    assert [out["meta_info"]["input_top_logprobs"] for out in at_end.values()] == [[], []]
    for bad in (2.5, "2", True):
        for kind, (status, answer) in both(servers, "POST", "/generate", {**body, "top_logprobs_num": bad}).items():
            assert status == 400, (kind, bad, answer)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_output_top_logprobs_while_generating_are_sglangs(servers, hf, prompt, temperature):
    """`top_logprobs_num` k with max_new_tokens > 0 (SGLang serves it; the CPU engine refused it
    before 2026-12-06): `output_top_logprobs` one row per output token, the top k of the
    distribution it was sampled from, log_softmax(logits / T) (T = 1 greedy: the sampler's own
    log-probs, `layers/sampler.py::Sampler.forward`), HF's on each server's own tokens; with
    logprob_start_len 0 the input rows too, and no extra row for the prompt's end."""
    k, new = 3, 4
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": k, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": new, "temperature": temperature, "ignore_eos": True}}
    outputs = generated(servers, body)
    if temperature == 0:
        assert outputs["cpu"]["output_ids"] == outputs["sglang"]["output_ids"]
    for kind, out in outputs.items():
        meta, ids = out["meta_info"], out["output_ids"]
        rows = meta["output_top_logprobs"]
        assert len(ids) == new and len(rows) == new, (kind, rows)
        assert len(meta["input_top_logprobs"]) == len(prompt) and meta["input_top_logprobs"][0] is None, kind
        assert all(len(row) == k and all(e[2] is None for e in row) for row in rows), kind
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        top = torch.log_softmax(logits / (temperature or 1.0), dim=-1).topk(k, dim=-1)
        assert [[e[1] for e in row] for row in rows] == top.indices.tolist(), kind
        torch.testing.assert_close(torch.tensor([[e[0] for e in row] for row in rows]), top.values, atol=ATOL,
                                   rtol=0, msg=lambda m: f"{kind}: {m}")


def test_weight_pushes_outside_a_session_are_refused_and_inside_one_load(servers, hf, qwen2_dir, prompt):
    junk = "bm90IGEgcGlja2xl"  # base64 of b"not a pickle": refused before it is read
    for path, body in [("/update_weights_from_tensor", {"serialized_named_tensors": [junk]}),
                       ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                             "shapes": [[47, 128]]})]:
        name = path.removeprefix("/")
        assert assert_same(both(servers, "POST", path, body)) == (400, {
            "success": False, "message": f"{name} must run between begin_weight_update() and end_weight_update()"})
    assert assert_same(both(servers, "POST", "/end_weight_update", {}))[0] == 400
    assert assert_same(both(servers, "POST", "/begin_weight_update", {}))[0] == 200
    try:
        assert assert_same(both(servers, "POST", "/begin_weight_update", {}))[0] == 400
        no_group = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[47, 128]]}
        status, body = assert_same(both(servers, "POST", "/update_weights_from_distributed", no_group))
        assert status == 400 and "init_weights_update_group" in body["message"]
        doubled = tensor_payload.shared_cpu_copy(hf.model.norm.weight.detach() * 2)  # held until both answered
        push = {"serialized_named_tensors": [tensor_payload.serialize([("model.norm.weight", doubled)])],
                "weight_version": "v-tensor"}
        assert assert_same(both(servers, "POST", "/update_weights_from_tensor", push)) == (
            200, {"success": True, "message": "Success Weight version updated to v-tensor."})
    finally:
        assert assert_same(both(servers, "POST", "/end_weight_update", {})) == (200, {"success": True,
                                                                                       "message": "Success"})
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4}, "return_logprob": True}
    outputs = generated(servers, body)
    ids = outputs["sglang"]["output_ids"]
    assert outputs["cpu"]["output_ids"] == ids
    with torch.no_grad():
        hf.model.norm.weight.mul_(2)
    try:
        oracle = hf_log_probs(hf, prompt + ids)[len(prompt) - 1:]
    finally:
        with torch.no_grad():
            hf.model.norm.weight.div_(2)
    assert (oracle - hf_log_probs(hf, prompt + ids)[len(prompt) - 1:]).abs().max() > 1e-2  # the push changed them
    for kind, out in outputs.items():
        assert_log_probs(out["meta_info"]["output_token_logprobs"], oracle, kind)
    assert assert_same(both(servers, "POST", "/update_weights_from_disk", {"model_path": qwen2_dir}))[0] == 200


@pytest.mark.parametrize("path, body, field", [
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights_from_tensor", {}, "serialized_named_tensors"),
    ("/update_weight_version", {}, "new_version"),
    ("/release_memory_occupation", None, "body"),  # no body at all
    ("/resume_memory_occupation", None, "body"),
])
def test_a_missing_field_is_refused_with_sglangs_error(servers, path, body, field):
    for kind, (status, answer) in both(servers, "POST", path, body).items():
        assert status == 400, (kind, answer)
        assert {k: answer[k] for k in ("object", "type", "param", "code")} == {
            "object": "error", "type": "Bad Request", "param": None, "code": 400}, kind
        assert "'msg': 'Field required'" in answer["message"] and f"'{field}'" in answer["message"], kind


def test_generate_without_input_is_refused(servers):
    assert assert_same(both(servers, "POST", "/generate", {"sampling_params": {"max_new_tokens": 1}})) == (
        400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})


GUARDED = [("GET", "/model_info"), ("GET", "/server_info"), ("GET", "/v1/models"), ("POST", "/generate"),
           ("POST", "/flush_cache"), ("POST", "/abort_request"), ("POST", "/pause_generation"),
           ("POST", "/continue_generation"), ("POST", "/release_memory_occupation"),
           ("POST", "/resume_memory_occupation"), ("POST", "/begin_weight_update"),
           ("POST", "/update_weights_from_tensor"), ("POST", "/update_weights_from_distributed"),
           ("POST", "/update_weights_from_disk"), ("POST", "/init_weights_update_group"),
           ("POST", "/update_weight_version")]


def test_the_api_key_guards_everything_but_health(servers):
    """SGLang 0.5.23 `utils/auth.py::decide_request_auth`: with --api-key every path but /health*,
    /ready and /metrics needs `Authorization: Bearer KEY`."""
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in GUARDED:
            assert assert_same(both(servers, method, path, {}, headers=headers)) == (401, {"error": "Unauthorized"}), \
                (method, path, headers)
    for path in ("/health", "/health_generate"):
        assert assert_same(both(servers, "GET", path, headers={})) == (200, "")


def test_the_control_calls_megarl_makes(servers, qwen2_dir, prompt):
    """`megarl.rollout.control.ServerControl`'s calls: same status and the same body."""
    status, text = assert_same(both(servers, "POST", "/flush_cache"))
    assert status == 200 and text.startswith("Cache flushed.")
    assert assert_same(both(servers, "POST", "/abort_request", {"abort_all": True})) == (200, "")
    assert assert_same(both(servers, "POST", "/abort_request", {"rid": "nobody"})) == (200, "")
    assert assert_same(both(servers, "POST", "/pause_generation", {"mode": "abort"}))[0] == 200
    assert assert_same(both(servers, "POST", "/continue_generation", {}))[0] == 200
    assert assert_same(both(servers, "POST", "/update_weight_version", {"new_version": "v-diff"})) == (
        200, {"success": True, "message": "Weight version updated to v-diff", "new_version": "v-diff"})
    assert {kind: body["weight_version"] for kind, (_, body) in both(servers, "GET", "/model_info").items()} == {
        "sglang": "v-diff", "cpu": "v-diff"}
    reload = {"model_path": qwen2_dir, "weight_version": "v-disk"}
    assert assert_same(both(servers, "POST", "/update_weights_from_disk", reload)) == (
        200, {"success": True, "message": "Succeeded to update model weights. Weight version updated to v-disk.",
              "num_paused_requests": 0})
    outputs = generated(servers, {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 3}})
    assert outputs["cpu"]["output_ids"] == outputs["sglang"]["output_ids"]
    assert [out["meta_info"]["weight_version"] for out in outputs.values()] == ["v-disk", "v-disk"]


def test_memory_release_and_resume_follow_sglangs_state_machine(servers, prompt):
    """SGLang 0.5.23 `managers/scheduler_components/weight_updater.py`: a release adds each tag to the
    released ones, any string, twice is fine; a resume removes each (a tag not released: the last test);
    None or []: kv_cache, weights and cuda_graph. Both answer 200 with a null body."""
    ok = (200, None)
    steps = [("/release_memory_occupation", ["no-such-memory"]), ("/resume_memory_occupation", ["no-such-memory"]),
             ("/release_memory_occupation", ["kv_cache"]), ("/release_memory_occupation", ["kv_cache"]),
             ("/resume_memory_occupation", ["kv_cache"]),
             ("/release_memory_occupation", ["weights", "cuda_graph"]),
             ("/resume_memory_occupation", ["cuda_graph", "weights"]),
             ("/release_memory_occupation", None), ("/resume_memory_occupation", []),
             ("/release_memory_occupation", []), ("/resume_memory_occupation", None)]
    wait_idle(servers)
    for path, tags in steps:
        assert assert_same(both(servers, "POST", path, {"tags": tags})) == ok, (path, tags)
    assert generated(servers, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})


def test_generating_on_released_memory_is_where_the_stand_in_is_stricter(servers, prompt):
    """SGLang checks nothing: on a CPU, without its memory saver, nothing was freed and it generates;
    on a GPU with the memory saver (megarl's colocated runs) it would run on freed memory. The CPU
    engine refuses instead (HTTP 400), so that a megarl bug generating between release and resume
    fails on the CPU too."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    for tags in (["weights"], ["kv_cache"]):
        wait_idle(servers)
        assert assert_same(both(servers, "POST", "/release_memory_occupation", {"tags": tags})) == (200, None)
        try:
            answers = both(servers, "POST", "/generate", body)
            assert answers["sglang"][0] == 200
            assert answers["cpu"][0] == 400 and "released" in answers["cpu"][1]["error"]["message"]
        finally:
            assert assert_same(both(servers, "POST", "/resume_memory_occupation", {"tags": tags})) == (200, None)


def test_resuming_memory_not_released_ends_both_servers(servers):
    """The last test of the module: SGLang's `offload_tags.remove(tag)` raises KeyError in its
    scheduler, which ends the whole server; the request gets no answer. The CPU engine ends alike."""
    for kind in KINDS:
        with pytest.raises(requests.ConnectionError):
            ask(servers[kind], "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
        deadline = time.monotonic() + 60
        while servers[kind].is_running():
            assert time.monotonic() < deadline, f"{kind}: the server did not exit"
            time.sleep(0.5)
