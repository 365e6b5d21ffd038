"""SGLang's input log-probs on the CPU engine (`return_logprob` + `logprob_start_len`, entries in
`meta_info.input_token_logprobs`), and the client's `score` that an SGLang teacher answers with:
the numbers are the HF model's own log-probs of those tokens, log_softmax(logits) whatever the
request's temperature, as SGLang 0.5.23 computes them (tests/sglang/test_differential.py holds
the CPU engine to a real SGLang server on this; the client's scores against a real SGLang teacher
are in tests/sglang/test_teacher_scoring.py)."""
import pytest
import requests
import torch

from megarl.rollout.client import (RolloutClient, RolloutRequestError, input_log_probs, input_top_log_probs,
                                   reported_input_id_matches)

SEQUENCES = [[5, 6, 7, 8, 9, 10], [9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]
VOCAB = 128  # the tiny model's (tests/rollout/conftest.py)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, helpers):
    proc = helpers.start_cpu_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), "scoring-server")
    yield proc
    proc.stop(timeout_s=15)


def hf_input_log_probs(model, ids, temperature=1.0):
    """[len(ids) - 1]: log p(ids[t] | ids[:t]) for t >= 1, from one HF forward (the oracle)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_scores_equal_the_hf_models_log_probs(server, tiny_hf):
    starts = [0, 2, 7]  # the whole sequence, from the third token, the last token only (nothing to score)
    with RolloutClient(server.url, max_retries=1, vocab_size=VOCAB) as client:
        scores = client.score(SEQUENCES, starts)
    for ids, start, got in zip(SEQUENCES, starts, scores):
        assert len(got) == len(ids) - start - 1
        expected = hf_input_log_probs(tiny_hf, ids)[start:]
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=1e-5)
    # negative control: another temperature's numbers differ
    other = hf_input_log_probs(tiny_hf, SEQUENCES[0], 0.7)
    assert not torch.allclose(torch.tensor(scores[0]), other, atol=1e-3)
    with pytest.raises(ValueError, match="vocab_size"), RolloutClient(server.url) as client:
        client.score(SEQUENCES, starts)


def test_top_k_scores_equal_the_hf_models_top_k(server, tiny_hf):
    """`score_top_k` on the CPU engine (the wire format is held to real SGLang's in
    tests/sglang/test_differential.py): per sequence the `score` log-probs and HF's top k of
    log_softmax(logits) at each scored position, ids and values."""
    starts, k = [0, 2, 7], 3
    with RolloutClient(server.url, max_retries=1, vocab_size=VOCAB) as client:
        scored = client.score_top_k(SEQUENCES, starts, k)
        with pytest.raises(ValueError, match="k=129 must be in \\[1, vocab_size=128\\]"):
            client.score_top_k(SEQUENCES, starts, VOCAB + 1)
    for ids, start, (scores, values, top_ids) in zip(SEQUENCES, starts, scored):
        torch.testing.assert_close(torch.tensor(scores), hf_input_log_probs(tiny_hf, ids)[start:], atol=1e-5, rtol=1e-5)
        with torch.no_grad():
            logits = tiny_hf(input_ids=torch.tensor([ids])).logits[0].float()
        top = torch.log_softmax(logits[start:-1], dim=-1).topk(k, dim=-1)
        assert top_ids == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(values).reshape(-1, k), top.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("extra, message", [
    ({"top_logprobs_num": VOCAB + 1}, "top_logprobs_num=129 is more than the vocabulary's 128 tokens"),
    ({"top_logprobs_num": 2.5}, "top_logprobs_num=2.5: Input should be a valid integer"),
])
def test_top_logprobs_the_cpu_engine_does_not_serve_are_refused(server, extra, message):
    """Past the vocabulary SGLang 0.5.23's scheduler dies (measured; `logprobs.topk`): the stand-in
    answers 400."""
    body = {"input_ids": SEQUENCES[0], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}, **extra}
    resp = requests.post(server.url + "/generate", json=body, timeout=60)
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_output_top_logprobs_are_those_of_each_generated_tokens_distribution(server, tiny_hf, temperature):
    """top_logprobs_num k while generating: per output token the k most likely tokens of the
    distribution it was sampled from, log_softmax(logits / T) (T = 1 greedy) as its own log-prob,
    HF's on the same tokens (the oracle); the sampled token's entry among them where it is in the
    top k (greedy: first). Held to a real SGLang server in tests/sglang/test_differential.py."""
    k, ids = 4, SEQUENCES[2]
    body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": k,
            "sampling_params": {"max_new_tokens": 5, "temperature": temperature, "ignore_eos": True,
                                "sampling_seed": 3}}
    meta = requests.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    out = [e[1] for e in meta["output_token_logprobs"]]
    rows = meta["output_top_logprobs"]
    assert len(out) == 5 and len(rows) == 5 and meta["input_top_logprobs"] == []
    with torch.no_grad():
        logits = tiny_hf(input_ids=torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
    top = torch.log_softmax(logits / (temperature or 1.0), dim=-1).topk(k, dim=-1)
    assert [[e[1] for e in row] for row in rows] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[e[0] for e in row] for row in rows]), top.values, atol=1e-5, rtol=0)
    for token, (logprob, _, _), row in zip(out, meta["output_token_logprobs"], rows):
        assert all(e[0] == logprob for e in row if e[1] == token)  # the same numbers as the token's own
    if temperature == 0:
        assert [row[0][1] for row in rows] == out


def test_top_k_answers_of_another_shape_are_refused():
    ok = {"meta_info": {"input_top_logprobs": [None, [[-0.5, 9, None], [-1.5, 6, None]]]}}
    assert input_top_log_probs(ok, [5, 6], 0, 2) == ([[-0.5, -1.5]], [[9, 6]])
    with pytest.raises(RolloutRequestError, match="input_top_logprobs: none"):
        input_top_log_probs({"meta_info": {}}, [5, 6], 0, 2)
    with pytest.raises(RolloutRequestError, match="expected null then 1 rows of top_logprobs_num=3"):
        input_top_log_probs(ok, [5, 6], 0, 3)
    with pytest.raises(RolloutRequestError, match="sequence 4|prompt 4"):
        input_top_log_probs(ok, [5, 6, 7], 0, 2, index=4)  # a row missing at the end


def test_the_wire_format_is_sglangs(server):
    ids = SEQUENCES[0]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0}}
    out = requests.post(server.url + "/generate", json=body, timeout=60).json()
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None and all(e[2] is None for e in entries)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    # without logprob_start_len (-1), or at the input's length: none (SGLang 0.5.23 sets -1 to the
    # input's length, `managers/scheduler.py::handle_generate_request`)
    body["sampling_params"]["max_new_tokens"] = 2
    for start in (-1, len(ids)):
        out = requests.post(server.url + "/generate", json={**body, "logprob_start_len": start}, timeout=60).json()
        assert out["meta_info"]["input_token_logprobs"] == []
        assert len(out["meta_info"]["output_token_logprobs"]) == 2
    # the last one: null
    out = requests.post(server.url + "/generate", json={**body, "logprob_start_len": len(ids) - 1}, timeout=60).json()
    assert out["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]


def test_ids_from_the_vocabularys_end_are_named_0_in_the_entries(server, tiny_hf):
    """SGLang 0.5.23 reports input ids >= vocab_size - 1 as 0, the log-prob still the real token's
    (`managers/scheduler_components/logprob_result_processor.py`); output entries keep theirs."""
    last = tiny_hf.config.vocab_size - 1
    ids = [5, last, 6, last - 1]
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}}
    entries = requests.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [5, 0, 6, last - 1]
    torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), hf_input_log_probs(tiny_hf, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start", [7, 99, -2, "0"])
def test_a_start_past_the_input_is_refused_as_sglang_aborts_it(server, start):
    body = {"input_ids": SEQUENCES[0], "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": 0}}
    resp = requests.post(server.url + "/generate", json=body, timeout=60)
    assert resp.status_code == 400 and "logprob_start_len" in resp.json()["error"]["message"]


def test_answers_that_do_not_match_the_sequence_are_refused():
    ok = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 6, None]]}}
    assert input_log_probs(ok, [5, 6], 0, VOCAB) == [-1.5]
    with pytest.raises(RolloutRequestError, match="sequence 3|prompt 3"):
        input_log_probs(ok, [5, 7], 0, VOCAB, index=3)
    with pytest.raises(RolloutRequestError, match="input_token_logprobs: none"):
        input_log_probs({"meta_info": {}}, [5, 6], 0, VOCAB)
    with pytest.raises(RolloutRequestError, match="null there"):
        input_log_probs({"meta_info": {"input_token_logprobs": [[-0.1, 5, None], [-1.5, 6, None]]}}, [5, 6], 0, VOCAB)
    with pytest.raises(RolloutRequestError, match="expected one entry for each of the 3 input tokens"):
        input_log_probs(ok, [5, 6, 7], 0, VOCAB)  # an entry missing at the end


@pytest.mark.parametrize("reported, sent, matches", [
    (5, 5, True),    # an id below vocab_size - 1: reported as sent
    (0, 5, False),   # ... and never as 0
    (6, 5, False),   # another id
    (0, 0, True),    # id 0 itself
    (0, 46, True),   # vocab_size - 1 (47 tokens): SGLang 0.5.23 reports 0
    (46, 46, True),  # ... or a server that does not clip reports it as sent
    (45, 46, False),  # anything else still does not match
    (0, 47, True),   # past the vocabulary (SGLang's rule is >= vocab_size - 1)
    (0, 45, False),  # vocab_size - 2 is not clipped
])
def test_sglangs_reported_input_ids_per_case(reported, sent, matches):
    assert reported_input_id_matches(reported, sent, 47) is matches


def test_the_last_vocabulary_id_comes_back_as_0_and_is_read():
    answer = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 0, None], [-0.5, 7, None]]}}
    assert input_log_probs(answer, [5, 46, 7], 0, 47) == [-1.5, -0.5]
    with pytest.raises(RolloutRequestError, match="ids \\[5, 0, 7\\]"):
        input_log_probs(answer, [5, 45, 7], 0, 47)
