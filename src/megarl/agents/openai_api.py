"""The OpenAI wire format megarl's endpoint speaks: parsing requests into token ids + SGLang
sampling parameters, and building response bodies and stream chunks. Pure functions.

Supported: `/v1/chat/completions` (messages rendered with the policy tokenizer's chat template,
as megarl renders dataset prompts) and `/v1/completions` (prompt as text or as token ids), `n=1`,
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k` (extra), `stop`, `seed`,
`logprobs`, `stream` with `stream_options.include_usage`. The trajectory id of a call comes from
the `X-Megarl-Trajectory` header or the body field `megarl_trajectory_id`. Anything else is
refused with HTTP 400 and an OpenAI error body naming the parameter.

During training (`SamplingDefaults.fixed`) a request's temperature, top_p, top_k and seed are
ignored: every call samples with the run's rollout settings, so that the recorded log-probs are
those the trainer recomputes (at `rollout.temperature`); validation episodes likewise sample
with `rollout.val_kwargs`. `max_tokens` is honoured up to the server's `max_new_tokens` ceiling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping, Optional

from megarl.data.prompts import render_chats
from megarl.rollout.protocol import BadRequestError, SamplingParams

TRAJECTORY_HEADER = "X-Megarl-Trajectory"
TRAJECTORY_FIELD = "megarl_trajectory_id"

_COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream", "stream_options",
                "seed", "logprobs", "user", "frequency_penalty", "presence_penalty", TRAJECTORY_FIELD}
# chat_template_kwargs: SGLang 0.5.23's extension of the chat request (entrypoints/openai/protocol.py
# `ChatCompletionRequest.chat_template_kwargs`), over the server's defaults key by key (serving_chat.py)
CHAT_KEYS = _COMMON_KEYS | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"}
COMPLETION_KEYS = _COMMON_KEYS | {"prompt", "echo"}
ROLES = ("system", "user", "assistant", "tool", "developer")


class OpenAIRequestError(ValueError):
    """A request refused with HTTP 400; `param` names the offending field (or None)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
        self.param, self.code = param, code
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        return error_body(str(self), "invalid_request_error", self.param, self.code)


def error_body(message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class SamplingDefaults:
    """The server's sampling: `max_new_tokens` is the default and the ceiling of `max_tokens`;
    with `fixed`, temperature/top_p/top_k are always these and requests cannot change them."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    fixed: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    kind: Literal["chat", "text"]
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    logprobs: bool
    trajectory_id: Optional[str]


@dataclass(frozen=True)
class Completion:
    """A call's answer: the sampled ids, their log-probs, the text shown to the user, the reason."""

    output_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int


# ---------------------------------------------------------------------------------- parsing
def parse_chat_request(body: Any, tokenizer, defaults: SamplingDefaults, header_trajectory: Optional[str] = None,
                       template_kwargs: Optional[Mapping[str, Any]] = None) -> CompletionRequest:
    """`template_kwargs`: the endpoint's chat-template variables, which the call's own
    `chat_template_kwargs` override key by key."""
    body = _check_keys(body, CHAT_KEYS)
    own = body.get("chat_template_kwargs")
    if own is not None and not isinstance(own, dict):
        raise OpenAIRequestError("chat_template_kwargs must be an object of the chat template's variables",
                                 "chat_template_kwargs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("messages must be a non-empty list of {role, content} objects", "messages")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    if body.get("top_logprobs") not in (None, 0):
        raise OpenAIRequestError("top_logprobs is not supported (only the sampled tokens' log-probs)", "top_logprobs")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise OpenAIRequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    prompt_ids = list(render_chats(tokenizer, [chat], {**(template_kwargs or {}), **(own or {})})[0])
    return _request("chat", body, prompt_ids, limit, defaults, bool(body.get("logprobs")), header_trajectory)


def parse_completion_request(body: Any, tokenizer, defaults: SamplingDefaults,
                             header_trajectory: Optional[str] = None) -> CompletionRequest:
    body = _check_keys(body, COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = list(prompt)
    else:
        raise OpenAIRequestError("prompt must be one non-empty string or one non-empty list of token ids", "prompt")
    if body.get("echo"):
        raise OpenAIRequestError("echo is not supported", "echo")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise OpenAIRequestError("logprobs must be 0 or 1 (only the sampled tokens' log-probs)", "logprobs")
    return _request("text", body, prompt_ids, body.get("max_tokens"), defaults, logprobs == 1, header_trajectory)


def _check_keys(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise OpenAIRequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIRequestError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise OpenAIRequestError(f"{key} is not supported (only 0)", key)
    if body.get("n") not in (None, 1):
        raise OpenAIRequestError("n must be 1: one call, one sample (start several calls for several samples)", "n")
    return body


def _message(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise OpenAIRequestError(f"{where} must be an object with a role in {ROLES}", where)
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise OpenAIRequestError(f"{where}.content: only text parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise OpenAIRequestError(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": message["role"], "content": content}


def _request(kind, body: dict, prompt_ids: list[int], limit: Any, defaults: SamplingDefaults, logprobs: bool,
             header_trajectory: Optional[str]) -> CompletionRequest:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise OpenAIRequestError(f"max_tokens must be an integer >= 1, got {limit!r}", "max_tokens")
    max_new = defaults.max_new_tokens if limit is None else min(limit, defaults.max_new_tokens)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise OpenAIRequestError("stream_options must be an object", "stream_options")
    model = body.get("model")
    if not isinstance(model, str):
        raise OpenAIRequestError("model must be a string", "model")
    field_trajectory = body.get(TRAJECTORY_FIELD)
    if field_trajectory is not None and not isinstance(field_trajectory, str):
        raise OpenAIRequestError(f"{TRAJECTORY_FIELD} must be a string", TRAJECTORY_FIELD)
    if header_trajectory and field_trajectory and header_trajectory != field_trajectory:
        raise OpenAIRequestError(f"the {TRAJECTORY_HEADER} header and {TRAJECTORY_FIELD} disagree", TRAJECTORY_FIELD)
    if defaults.fixed:
        temperature, top_p, top_k, seed = defaults.temperature, defaults.top_p, defaults.top_k, None
    else:
        temperature = _number(body, "temperature", defaults.temperature)
        top_p = _number(body, "top_p", defaults.top_p)
        top_k = body.get("top_k", defaults.top_k)
        seed = body.get("seed")
    try:
        sampling = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k,
                                  stop=body.get("stop"), sampling_seed=seed)
    except BadRequestError as e:  # its message names the field as sampling_params.<key>
        raise OpenAIRequestError(str(e).replace("sampling_params.", "")) from None
    return CompletionRequest(kind, model, prompt_ids, sampling, bool(body.get("stream")),
                             bool(stream_options.get("include_usage")), logprobs,
                             header_trajectory or field_trajectory)


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise OpenAIRequestError(f"{key} must be a number, got {value!r}", key)
    return float(value)


# ---------------------------------------------------------------------------------- answers
def completion_text(tokenizer, output_ids: list[int], matched: Any) -> str:
    """The text a user sees: the sampled ids decoded with special tokens kept, so that a chat that
    quotes it back re-renders to the very ids that were sampled; without the stop token that ended
    it (the chat template writes its own end of turn); a matched stop string cut off (OpenAI's
    rule; such a reply no longer re-renders to the sampled ids: see trajectory.py)."""
    if isinstance(matched, int) and output_ids and output_ids[-1] == matched:
        output_ids = output_ids[:-1]
    text = tokenizer.decode(output_ids, skip_special_tokens=False)
    if isinstance(matched, str) and matched in text:
        text = text[: text.find(matched)]
    return text


def _usage(c: Completion) -> dict[str, int]:
    n = len(c.output_ids)
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": n, "total_tokens": c.prompt_tokens + n}


def _logprobs_body(req: CompletionRequest, c: Completion, tokenizer) -> Optional[dict[str, Any]]:
    if not req.logprobs:
        return None
    tokens = tokenizer.convert_ids_to_tokens(c.output_ids)
    if req.kind == "chat":
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(tokens, c.logprobs)]}
    return {"tokens": tokens, "token_logprobs": list(c.logprobs), "top_logprobs": None, "text_offset": None}


def response_body(req: CompletionRequest, c: Completion, rid: str, created: int, tokenizer) -> dict[str, Any]:
    """The non-streaming answer (`chat.completion` or `text_completion`)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": c.finish_reason, "logprobs": _logprobs_body(req, c, tokenizer)}
    if req.kind == "chat":
        choice["message"] = {"role": "assistant", "content": c.text}
        kind = "chat.completion"
    else:
        choice["text"] = c.text
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": req.model, "choices": [choice], "usage": _usage(c)}


def stream_chunks(req: CompletionRequest, c: Completion, rid: str, created: int, tokenizer) -> Iterator[dict]:
    """The answer as OpenAI stream chunks, one per sampled token that adds text (their deltas
    concatenate to `c.text`), then the chunk with the finish reason, then usage if asked."""
    kind = "chat.completion.chunk" if req.kind == "chat" else "text_completion"

    def chunk(delta: str, finish: Optional[str], first: bool = False) -> dict:
        if req.kind == "chat":
            choice = {"index": 0, "delta": ({"role": "assistant", "content": delta} if first else {"content": delta}),
                      "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
        return {"id": rid, "object": kind, "created": created, "model": req.model, "choices": [choice]}

    if req.kind == "chat":
        yield chunk("", None, first=True)
    sent = 0
    for i in range(len(c.output_ids)):
        upto = min(len(tokenizer.decode(c.output_ids[: i + 1], skip_special_tokens=False)), len(c.text))
        if upto > sent:
            yield chunk(c.text[sent:upto], None)
            sent = upto
    if sent < len(c.text):
        yield chunk(c.text[sent:], None)
    last = chunk("", c.finish_reason)
    last["choices"][0]["logprobs"] = _logprobs_body(req, c, tokenizer)
    yield last
    if req.include_usage:
        yield {"id": rid, "object": kind, "created": created, "model": req.model, "choices": [], "usage": _usage(c)}
