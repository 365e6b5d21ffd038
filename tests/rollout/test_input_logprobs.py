"""SGLang's input log-probs on the CPU engine (`return_logprob` + `logprob_start_len`, entries in
`meta_info.input_token_logprobs`), and the client's `score` that an SGLang teacher answers with:
the numbers are the HF model's own log-probs of those tokens, log_softmax(logits) whatever the
request's temperature, as SGLang 0.5.23 computes them (tests/sglang/test_differential.py holds
the CPU engine to a real SGLang server on this)."""
import pytest
import requests
import torch

from megarl.rollout.client import RolloutClient, RolloutRequestError, input_log_probs

SEQUENCES = [[5, 6, 7, 8, 9, 10], [9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]


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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scores_are_the_hf_models_log_probs_at_temperature_one(server, tiny_hf, temperature):
    """The request's temperature changes nothing: SGLang 0.5.23's input log-probs are a plain
    log_softmax of the logits (`layers/logprob_processor.py::InputLogprobProcessor`)."""
    starts = [0, 2, 7]  # the whole sequence, from the third token, the last token only (nothing to score)
    with RolloutClient(server.url, max_retries=1) as client:
        scores = client.score(SEQUENCES, starts, temperature)
    for ids, start, got in zip(SEQUENCES, starts, scores):
        assert len(got) == len(ids) - start - 1
        expected = hf_input_log_probs(tiny_hf, ids)[start:]
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=1e-5)
    # negative control: the numbers at T = 0.7 differ
    at_t = hf_input_log_probs(tiny_hf, SEQUENCES[0], 0.7)
    assert not torch.allclose(torch.tensor(scores[0]), at_t, atol=1e-3)


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
    assert input_log_probs(ok, [5, 6], 0) == [-1.5]
    with pytest.raises(RolloutRequestError, match="sequence 3|prompt 3"):
        input_log_probs(ok, [5, 7], 0, index=3)
    with pytest.raises(RolloutRequestError, match="input_token_logprobs: none"):
        input_log_probs({"meta_info": {}}, [5, 6], 0)
    with pytest.raises(RolloutRequestError, match="null there"):
        input_log_probs({"meta_info": {"input_token_logprobs": [[-0.1, 5, None], [-1.5, 6, None]]}}, [5, 6], 0)
