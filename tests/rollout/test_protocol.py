"""SGLang's `/generate` wire format: what the client sends and what the CPU engine accepts."""
import pytest

from megarl.rollout.protocol import (
    SGLANG_SAMPLING_DEFAULTS,
    BadRequestError,
    SamplingParams,
    error_message,
    parse_generate_body,
)


def test_to_json_sends_only_sglang_keys_and_round_trips():
    params = SamplingParams(max_new_tokens=64, temperature=0.8, top_p=0.95, top_k=50, n=4, stop=("\n\n",),
                            stop_token_ids=(2,), ignore_eos=True, sampling_seed=7, no_stop_trim=True)
    wire = params.to_json()
    assert set(wire) <= set(SGLANG_SAMPLING_DEFAULTS)
    assert wire["stop"] == ["\n\n"] and wire["n"] == 4 and wire["top_k"] == 50
    assert SamplingParams.from_json(wire) == params


def test_defaults_are_left_out_and_top_k_off_is_not_sent():
    assert SamplingParams().to_json() == {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0}
    assert SamplingParams.from_json({"top_k": 1073741824}).top_k == -1


def test_unknown_sampling_key_is_refused_naming_it():
    with pytest.raises(BadRequestError, match="unknown field `bogus_key`"):
        SamplingParams.from_json({"max_new_tokens": 4, "bogus_key": 1})


def test_unsupported_key_only_at_its_default():
    assert SamplingParams.from_json({"min_p": 0.0, "repetition_penalty": 1.0, "spaces_between_special_tokens": False})
    with pytest.raises(BadRequestError, match="regex.*not supported"):
        SamplingParams.from_json({"regex": "[0-9]+"})


@pytest.mark.parametrize(
    "params, key",
    [({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"), ({"n": 0}, "n"),
     ({"max_new_tokens": 1.5}, "max_new_tokens"), ({"top_k": 0}, "top_k"), ({"stop": [1]}, "stop")],
)
def test_bad_values_name_the_key(params, key):
    with pytest.raises(BadRequestError, match=f"sampling_params.{key}"):
        SamplingParams.from_json(params)


def test_parse_single_batch_and_parallel_sampling():
    single = parse_generate_body({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}})
    assert not single.batched and single.prompts[0].prompt == [1, 2]
    batch = parse_generate_body({"input_ids": [[1], [2, 3]], "return_logprob": [True, False],
                                 "sampling_params": [{"n": 1}, {"n": 2}]})
    assert batch.batched and [p.return_logprob for p in batch.prompts] == [True, False]
    assert [p.sampling.n for p in batch.prompts] == [1, 2]
    parallel = parse_generate_body({"input_ids": [1], "sampling_params": {"n": 3}})
    assert parallel.batched  # n > 1 answers with a list, as SGLang does


@pytest.mark.parametrize(
    "body, match",
    [
        ({"input_ids": [1], "text": "a"}, "exactly one of"),
        ({"input_ids": [[1], []]}, "prompt 1 is empty"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "1 entries but the request has 2"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {"bogus": 1}]}, "prompt 1: unknown field `bogus`"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": "abc"}, "input_ids must be"),
    ],
)
def test_bad_bodies(body, match):
    with pytest.raises(BadRequestError, match=match):
        parse_generate_body(body)


def test_error_message_reads_both_sglang_error_shapes():
    assert error_message({"error": "unknown field"}, "x") == "unknown field"
    assert error_message({"error": {"message": "too long"}}, "x") == "too long"
    assert error_message("plain", "fallback") == "fallback"
