"""SGLang's native `/generate` wire format (version 0.5.23), shared by megarl's client and CPU engine.

Field names and defaults follow SGLang's JSON contract (`sglang/api/v1/api_types.py`). SGLang rejects
an unknown sampling key with HTTP 400, so the client only ever sends keys listed here, and the CPU
engine rejects what SGLang rejects. Response shapes:

    {"text": str, "output_ids": [int], "meta_info": {"id", "prompt_tokens", "completion_tokens",
     "finish_reason": {"type": "stop", "matched": int|str} | {"type": "length", "length": int}
                    | {"type": "abort", "message": str},
     "output_token_logprobs": [[logprob, token_id, null], ...], "weight_version", "e2e_latency", ...}}

With `return_logprob`, `meta_info.input_token_logprobs` lists the input tokens from `logprob_start_len`
(-1, the default: none) as [logprob, token_id, null]: entry i is log p(input[start + i] | input[:start + i])
under log_softmax(logits), whatever the request's temperature (SGLang 0.5.23
`layers/logprob_processor.py::InputLogprobProcessor`), except entry 0, always null (SGLang pads the
first one: `managers/scheduler_components/logprob_result_processor.py`,
`input_token_logprobs_val = [None] + ...`); an entry's token_id is 0 for ids from vocab_size - 1 up
(SGLang clips them there; the log-prob is the real token's). A scorer sends the whole sequence with
`logprob_start_len` 0 (or its prompt length - 1) and `max_new_tokens` 0. With `top_logprobs_num` k > 0
as well, `meta_info.input_top_logprobs` has one entry per `input_token_logprobs` entry: null first (none
at all when the start is the input's length), then the k most likely tokens at that position, each
[logprob, token_id, null] in descending order, their ids unclipped; and `output_top_logprobs` has, with
`max_new_tokens` 0, one entry: the top k after the whole input (SGLang 0.5.23
`managers/scheduler_components/logprob_result_processor.py::_process_input_top_logprobs`,
`managers/tokenizer_manager.py::detokenize_top_logprobs_tokens`; measured on its CPU server).

A request with one prompt and `n == 1` gets one such object; a batch of prompts, or `n > 1`, gets a
list ordered prompt-major (the `n` samples of prompt 0, then those of prompt 1, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# Every key of SGLang 0.5.23's `SamplingParams` contract, with its default.
SGLANG_SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 1073741824,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "stream_interval": None,
    "logit_bias": {},
    "sampling_seed": None,
    "custom_params": None,
    "beam_width": None,
    "watermark": None,
    "choice": [],
}
TOP_K_OFF = SGLANG_SAMPLING_DEFAULTS["top_k"]

# Keys megarl's `SamplingParams` carries. The other SGLang keys are accepted by the CPU engine only
# at their default value (they change nothing then); any other value is refused with HTTP 400.
SUPPORTED_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids",
        "ignore_eos", "sampling_seed", "no_stop_trim", "skip_special_tokens",
    }
)
# Text-formatting keys that do not change the sampled tokens: accepted at any value.
IGNORED_SAMPLING_KEYS = frozenset({"spaces_between_special_tokens", "stream_interval"})


class BadRequestError(ValueError):
    """A request the server refuses with HTTP 400; the message names the offending field."""


def _as_str_tuple(value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise BadRequestError(f"sampling_params.{key} must be a string or a list of strings, got {value!r}")


def _as_int_tuple(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise BadRequestError(f"sampling_params.{key} must be a list of token ids, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one `/generate` request, in SGLang's names and meanings.

    `temperature == 0` is greedy decoding. `top_k == -1` (or SGLang's 1073741824) turns top-k off.
    `stop` strings need a tokenizer on the server; `stop_token_ids` do not. EOS ends a sample unless
    `ignore_eos`. With `sampling_seed`, sample j of the `n` uses seed `sampling_seed + j`.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        def check(ok: bool, key: str, rule: str) -> None:
            if not ok:
                raise BadRequestError(f"sampling_params.{key} {rule}, got {getattr(self, key)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        check(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens", "must be an int >= 0")
        check(isinstance(self.temperature, (int, float)) and self.temperature >= 0, "temperature", "must be >= 0")
        check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (off) or >= 1")
        check(is_int(self.n) and self.n >= 1, "n", "must be an int >= 1")
        check(self.sampling_seed is None or is_int(self.sampling_seed), "sampling_seed", "must be an int or null")
        object.__setattr__(self, "stop", _as_str_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids, "stop_token_ids"))

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k != -1 and self.top_k < TOP_K_OFF

    def to_json(self) -> dict[str, Any]:
        """The `sampling_params` dict SGLang accepts: only SGLang's keys, defaults left out."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
        }
        if self.top_k_enabled:
            out["top_k"] = self.top_k
        if self.n != 1:
            out["n"] = self.n
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        if self.no_stop_trim:
            out["no_stop_trim"] = True
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        return out

    @classmethod
    def from_json(cls, params: Any) -> SamplingParams:
        """Parse a request's `sampling_params` as SGLang would; `BadRequestError` names the bad key."""
        if params is None:
            return cls()
        if not isinstance(params, dict):
            raise BadRequestError(f"sampling_params must be a JSON object, got {type(params).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in params.items():
            if key not in SGLANG_SAMPLING_DEFAULTS:
                expected = ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_DEFAULTS)
                raise BadRequestError(f"unknown field `{key}` in sampling_params, expected one of {expected}")
            if key in SUPPORTED_SAMPLING_KEYS:
                if value is not None:
                    kwargs[key] = value
            elif key not in IGNORED_SAMPLING_KEYS and value != SGLANG_SAMPLING_DEFAULTS[key]:
                raise BadRequestError(
                    f"sampling_params.{key}={value!r} is not supported by the megarl CPU engine "
                    f"(only its default {SGLANG_SAMPLING_DEFAULTS[key]!r} is accepted)"
                )
        if kwargs.get("top_k") == TOP_K_OFF:
            kwargs["top_k"] = -1
        return cls(**kwargs)


@dataclass(frozen=True)
class PromptRequest:
    """One prompt of a `/generate` body: token ids or text, with its own sampling and options."""

    prompt: list[int] | str
    sampling: SamplingParams
    return_logprob: bool = False
    rid: Optional[str] = None
    lora_path: Optional[str] = None  # the LoRA adapter's name (SGLang's field name), None: the base model
    return_routed_experts: bool = False  # see megarl.rollout.routed_experts
    routed_experts_start_len: int = 0
    # with return_logprob: `meta_info.input_token_logprobs` covers input positions [start, prompt
    # tokens) (SGLang's `logprob_start_len`; -1: none, as a start at the prompt's length)
    logprob_start_len: int = -1
    # with return_logprob: the top tokens per position to report (SGLang's `top_logprobs_num`; <= 0: none)
    top_logprobs_num: int = 0


@dataclass(frozen=True)
class GenerateBody:
    """A parsed `/generate` body. `batched` is True when the reply must be a list."""

    prompts: list[PromptRequest] = field(default_factory=list)
    batched: bool = False


def _per_prompt(value: Any, count: int, key: str) -> list[Any]:
    """SGLang lets most fields be one value for all prompts or a list with one value per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequestError(f"{key} has {len(value)} entries but the request has {count} prompts")
        return value
    return [value] * count


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def parse_generate_body(body: Any) -> GenerateBody:
    """Normalize a `/generate` JSON body. Unknown top-level keys are ignored, as SGLang does."""
    if not isinstance(body, dict):
        raise BadRequestError("the /generate body must be a JSON object")
    if body.get("stream"):
        raise BadRequestError("stream=true is not supported by the megarl CPU engine")
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is None and text is None:
        raise BadRequestError("Either text, input_ids or input_embeds should be provided.")  # SGLang's words
    if input_ids is not None and text is not None:
        raise BadRequestError("give exactly one of `input_ids` and `text`")
    if input_ids is not None:
        if _is_token_list(input_ids):
            prompts, batched = [input_ids], False
        elif isinstance(input_ids, list) and input_ids and all(_is_token_list(p) for p in input_ids):
            prompts, batched = input_ids, True
        else:
            raise BadRequestError("input_ids must be a list of token ids or a non-empty list of such lists")
    elif isinstance(text, str):
        prompts, batched = [text], False
    elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        prompts, batched = text, True
    else:
        raise BadRequestError("text must be a string or a non-empty list of strings")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise BadRequestError(f"prompt {i} is empty")

    count = len(prompts)
    samplings = _per_prompt(body.get("sampling_params"), count, "sampling_params")
    logprobs = _per_prompt(body.get("return_logprob", False), count, "return_logprob")
    rids = _per_prompt(body.get("rid"), count, "rid")
    loras = _per_prompt(body.get("lora_path"), count, "lora_path")
    routed = _per_prompt(body.get("return_routed_experts", False), count, "return_routed_experts")
    starts = _per_prompt(body.get("routed_experts_start_len", 0), count, "routed_experts_start_len")
    logprob_starts = _per_prompt(body.get("logprob_start_len", -1), count, "logprob_start_len")
    top_nums = _per_prompt(body.get("top_logprobs_num", 0), count, "top_logprobs_num")
    parsed = []
    for i in range(count):
        try:
            sampling = SamplingParams.from_json(samplings[i])
        except BadRequestError as e:
            raise BadRequestError(f"prompt {i}: {e}" if batched else str(e)) from None
        start = starts[i]
        # SGLang 0.5.23 refuses a start outside [0, prompt tokens] (srt/managers/scheduler.py,
        # handle_generate_request: the request is aborted); here with HTTP 400
        if bool(routed[i]) and not (isinstance(start, int) and 0 <= start <= len(prompts[i])):
            raise BadRequestError(f"routed_experts_start_len={start!r} must be an int in [0, {len(prompts[i])}] "
                                  "(the number of input tokens)")
        logprob_start = logprob_starts[i]
        # SGLang 0.5.23 aborts a request whose logprob_start_len is higher than its input length
        # (srt/managers/scheduler.py, handle_generate_request; -1 means the input length), HTTP 400;
        # one below -1 fails its scheduler (an AssertionError ends the server): refused here too
        if bool(logprobs[i]) and not (isinstance(logprob_start, int) and not isinstance(logprob_start, bool)
                                      and -1 <= logprob_start <= len(prompts[i])):
            raise BadRequestError(f"logprob_start_len={logprob_start!r} is higher than the number of input tokens "
                                  f"{len(prompts[i])}, or not an int >= -1. Please use a smaller logprob_start_len.")
        # SGLang 0.5.23 answers HTTP 400 to a top_logprobs_num that is no int (a float, string or bool)
        if not isinstance(top_nums[i], int) or isinstance(top_nums[i], bool):
            raise BadRequestError(f"top_logprobs_num={top_nums[i]!r}: Input should be a valid integer")
        parsed.append(PromptRequest(prompts[i], sampling, bool(logprobs[i]), rids[i], lora_path=loras[i],
                                    return_routed_experts=bool(routed[i]), routed_experts_start_len=start,
                                    logprob_start_len=logprob_start, top_logprobs_num=top_nums[i]))
    batched = batched or any(p.sampling.n > 1 for p in parsed)
    return GenerateBody(parsed, batched)


def finish_stop(matched: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": matched}


def finish_length(length: int) -> dict[str, Any]:
    return {"type": "length", "length": length}


def finish_abort(message: str) -> dict[str, Any]:
    return {"type": "abort", "message": message}


def error_message(body: Any, fallback: str) -> str:
    """The human message in an SGLang error body (`{"error": str}`, `{"error": {"message": str}}`, or
    LoRA's `{"error_message": str}`)."""
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body.get("error_message")))
        if isinstance(err, dict):
            err = err.get("message")
        if isinstance(err, str) and err:
            return err
    return fallback
