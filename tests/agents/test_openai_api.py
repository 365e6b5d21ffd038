import pytest

from megarl.agents.openai_api import (
    Completion,
    OpenAIRequestError,
    SamplingDefaults,
    parse_chat_request,
    parse_completion_request,
    response_body,
    stream_chunks,
)
from megarl.data.prompts import render_chats

FREE = SamplingDefaults(max_new_tokens=16)
FIXED = SamplingDefaults(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=5, fixed=True)
CHAT = [{"role": "user", "content": "23+45="}]


def test_chat_prompt_is_the_chat_template_rendering(tokenizer):
    req = parse_chat_request({"model": "m", "messages": CHAT + [{"role": "assistant", "content": "68"},
                                                                {"role": "tool", "content": [{"type": "text", "text": "ok"}]}]},
                             tokenizer, FREE, header_trajectory="t1")
    chat = CHAT + [{"role": "assistant", "content": "68"}, {"role": "tool", "content": "ok"}]
    assert req.prompt_ids == render_chats(tokenizer, [chat])[0]
    assert req.trajectory_id == "t1" and req.kind == "chat" and req.sampling.max_new_tokens == 16


def test_a_calls_chat_template_kwargs_override_the_endpoints_key_by_key():
    """SGLang's rule (serving_chat.py): the server's default_chat_template_kwargs fill what the call
    left unset. Oracle: the tokenizer's own apply_chat_template with the merged variables."""
    from megarl.data.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                               "{{ a | default('') }}{{ b | default('') }}{% endif %}")
    chat = [{"role": "user", "content": "12"}]

    def rendered(**variables):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **variables)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    endpoint = {"a": "1", "b": "2"}
    assert parse_chat_request({"model": "m", "messages": chat}, tokenizer, FREE, template_kwargs=endpoint).prompt_ids == \
        rendered(a="1", b="2")
    assert parse_chat_request({"model": "m", "messages": chat, "chat_template_kwargs": {"b": "9"}}, tokenizer, FREE,
                              template_kwargs=endpoint).prompt_ids == rendered(a="1", b="9")
    with pytest.raises(OpenAIRequestError, match="chat_template_kwargs must be an object"):
        parse_chat_request({"model": "m", "messages": chat, "chat_template_kwargs": "b=9"}, tokenizer, FREE)


def test_sampling_is_the_runs_when_fixed_and_max_tokens_is_capped(tokenizer):
    body = {"model": "m", "messages": CHAT, "temperature": 0.1, "top_p": 0.5, "seed": 3, "max_tokens": 99, "stop": "x"}
    free = parse_chat_request(body, tokenizer, FREE).sampling
    assert (free.temperature, free.top_p, free.sampling_seed, free.max_new_tokens, free.stop) == (0.1, 0.5, 3, 16, ("x",))
    fixed = parse_chat_request(body, tokenizer, FIXED).sampling
    assert (fixed.temperature, fixed.top_p, fixed.top_k, fixed.sampling_seed) == (0.7, 0.9, 5, None)


def test_completion_prompt_as_text_or_token_ids(tokenizer):
    assert parse_completion_request({"model": "m", "prompt": "12+1="}, tokenizer, FREE).prompt_ids == \
        tokenizer("12+1=", add_special_tokens=False)["input_ids"]
    assert parse_completion_request({"model": "m", "prompt": [[1, 5, 6]], "megarl_trajectory_id": "x"},
                                    tokenizer, FREE).prompt_ids == [1, 5, 6]


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": CHAT, "bogus": 1}, "bogus"),
    ({"model": "m", "messages": CHAT, "n": 2}, "n"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"model": "m", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "messages": CHAT, "presence_penalty": 1.0}, "presence_penalty"),
    ({"model": "m", "messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT}, "model"),
    ({"model": "m", "messages": CHAT, "megarl_trajectory_id": "b"}, "megarl_trajectory_id"),  # header says "a"
])
def test_bad_chat_requests_name_the_parameter(tokenizer, body, param):
    with pytest.raises(OpenAIRequestError) as e:
        parse_chat_request(body, tokenizer, FREE, header_trajectory="a")
    assert e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_bad_completion_requests(tokenizer):
    for body in ({"model": "m", "prompt": ""}, {"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": [1.5]},
                 {"model": "m", "prompt": "a", "echo": True}, {"model": "m", "prompt": "a", "logprobs": 5}):
        with pytest.raises(OpenAIRequestError):
            parse_completion_request(body, tokenizer, FREE)
    with pytest.raises(OpenAIRequestError, match="temperature must be >= 0"):
        parse_completion_request({"model": "m", "prompt": "a", "temperature": -1}, tokenizer, FREE)


def test_stream_chunks_concatenate_to_the_answer(tokenizer):
    req = parse_chat_request({"model": "m", "messages": CHAT, "stream": True, "logprobs": True,
                              "stream_options": {"include_usage": True}}, tokenizer, FREE)
    ids = tokenizer("68", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    c = Completion(ids, [-0.1, -0.2, -0.3], "68", "stop", 7)
    chunks = list(stream_chunks(req, c, "id", 0, tokenizer))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == "68"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert [t["logprob"] for t in chunks[-2]["choices"][0]["logprobs"]["content"]] == [-0.1, -0.2, -0.3]
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    body = response_body(req, c, "id", 0, tokenizer)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "68"} and body["object"] == "chat.completion"
