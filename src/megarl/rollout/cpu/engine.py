"""megarl's CPU generation engine: a HF causal LM sampled in batches with a KV cache.

This is the model side of the CPU stand-in for an SGLang server (`server.py` puts it behind
SGLang's HTTP API). One scheduler thread takes up to `max_running_requests` waiting sequences of
one LoRA adapter (or none), prefills them together (left-padded), then decodes them step by step over
a KV cache allocated per batch (`kv_cache.py`), dropping finished rows from it. Each decode step is
one forward of the HF model over [B, 1] tokens (forward hooks on its modules see every step), one
batched sample, and tensor checks for stop ids and lengths. Requests that arrive meanwhile join the
running batch between two decode steps (continuous batching): they are prefilled on their own, their
KV rows appended to the batch's cache, and they are sampled with the others from the next step on.
Only sequences of the batch's adapter join, and none while another adapter's request waits ahead of
them, while generation is paused, or while a weight update waits for the model (updates run
between batches).

Output log-probs follow SGLang's default: the log-prob of the sampled token under softmax(logits / T),
before top-k/top-p filtering; greedy (T = 0) gives log_softmax(logits). A trainer recomputing
log-probs at the same temperature gets the same numbers (float32 on CPU). Input log-probs
(`return_logprob` with `logprob_start_len`) are log_softmax(logits) whatever the temperature, as
SGLang 0.5.23 computes them (`layers/logprob_processor.py::InputLogprobProcessor`).

Memory release/resume has nothing to free on CPU; it is kept as SGLang 0.5.23's state machine
(managers/scheduler_components/weight_updater.py, `release_memory_occupation` and
`resume_memory_occupation`): releasing asserts the server is idle and adds each tag to the released
ones, any string (None or []: all of `MEMORY_TAGS`); resuming removes each tag in the request's order
(`offload_tags.remove(tag)`), so a tag not released raises KeyError; either failure is an exception
in SGLang's scheduler, which exits and takes the server with it: here `SchedulerCrash`, on which the
server process exits. Generation and weight updates are refused while weights or the KV cache are
released: SGLang has no such check, but with its memory saver (GPU) it would run on freed memory.
"""
from __future__ import annotations

import inspect
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
)

from megarl.rollout.cpu.checkpoint_names import checkpoint_tensor, fused_on_disk, model_tensors
from megarl.rollout.cpu.fp8_weights import Fp8Weights, checkpoint_quantization, load_fp8_causal_lm
from megarl.rollout.cpu.decode_rows import DecodeRows
from megarl.rollout.cpu.lora_adapters import LoadedAdapter, LoraAdapters, applied
from megarl.rollout.cpu.kv_cache import append_rows, can_append_rows, gather_rows, is_preallocated, preallocated_cache
from megarl.rollout.protocol import (
    BadRequestError,
    SamplingParams,
    finish_abort,
    finish_length,
    finish_stop,
)
from megarl.rollout.cpu.route_recorder import RouteRecorder

log = logging.getLogger(__name__)

MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang 0.5.23 `constants.py::GPU_MEMORY_ALL_TYPES`


class SchedulerCrash(RuntimeError):
    """What makes SGLang's scheduler raise and exit, taking its server down (the CPU server exits
    on it): the stand-in fails where SGLang fails."""


# A batch starts once no request arrived for this long (`CPUEngine`'s `batch_wait_s`; the server's
# --batch-wait-ms): it covers the gaps within a client's burst (16 requests to one server over
# uvloop and httptools: median 0.3 ms, 99th percentile 1.7, largest 2.8 of 300).
BATCH_WAIT_S = 0.003
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_dtype(dtype: str) -> torch.dtype:
    """Server `--dtype`: "auto" and "float32" give float32 (the CPU default); else a torch dtype name."""
    if dtype in ("auto", "float32", "float"):
        return torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"--dtype {dtype!r} is not a floating-point torch dtype")
    return value


def load_causal_lm(model_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """Load an HF checkpoint directory for inference (eval mode, no grads)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.eval().requires_grad_(False)
    return model


def load_served_model(model_path: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Optional[Fp8Weights]]:
    """(model, its block-FP8 weights or None): `load_causal_lm`, or for a block-FP8 checkpoint
    (config.json's `quantization_config`) `load_fp8_causal_lm`, which dequantizes it per block.
    Raises ValueError for a quantized checkpoint SGLang would refuse."""
    serving = checkpoint_quantization(model_path) if os.path.isfile(os.path.join(model_path, "config.json")) else None
    if serving is not None:
        return load_fp8_causal_lm(model_path, serving, dtype)
    return load_causal_lm(model_path, dtype), None


def load_tokenizer_if_present(model_path: str):
    """The checkpoint's tokenizer, or None when the directory has no tokenizer files."""
    if not any(os.path.exists(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_path)


def eos_token_ids(model_path: str, config) -> frozenset[int]:
    """EOS ids from generation_config.json, else from config.json (an int or a list in either)."""
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


@dataclass(eq=False)
class Sequence:
    """One sample being generated: sample `index` of the `n` for request `rid`."""

    rid: str
    index: int
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool
    seed: Optional[int]  # sampling_seed + sample index; None: the engine's shared generator
    on_done: Callable[[Sequence], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[dict[str, Any]] = None
    text: str = ""
    error: Optional[str] = None
    abort_requested: bool = False
    created_s: float = field(default_factory=time.monotonic)
    finished_s: Optional[float] = None
    lora: Optional[LoadedAdapter] = None  # the adapter the request named (None: the base model)
    routed_experts_start_len: Optional[int] = None  # None: routes not asked for (return_routed_experts)
    routes: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, top_k] per forward it was in
    # return_logprob: SGLang's input log-probs of prompt positions [logprob_start_len, prompt), the first None
    logprob_start_len: int = -1
    input_logprobs: list[Optional[float]] = field(default_factory=list)
    # top_logprobs_num (> 0): per input position from logprob_start_len the k most likely tokens as
    # (logprob, id), descending, the first None; per output token those of the distribution it was
    # sampled from (with max_new_tokens 0: the top k after the whole prompt)
    top_logprobs_num: int = 0
    input_top_logprobs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    def routed_experts(self) -> torch.Tensor:
        """[positions, layers, top_k]: the routes of the positions [routed_experts_start_len,
        prompt + output - 1) (SGLang's rows: see megarl.rollout.routed_experts)."""
        return torch.cat(self.routes)[self.routed_experts_start_len :]


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    top_ks: torch.Tensor,
    generators: dict[int, torch.Generator],
    shared_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return (tokens [B], log-probs [B]).

    logits [B, V] float32; temperatures [B] (0 = greedy); top_ps [B]; top_ks [B] (V = off).
    `generators` maps the rows with their own generator (a `sampling_seed`) to it; the other sampled
    rows draw from `shared_generator` in one call. The log-prob is that of softmax(logits / T) before
    top-k/top-p filtering (SGLang's default).

    Draws are those of `torch.multinomial(probs, 1)`, which for one sample takes argmax(probs / q)
    with q ~ Exp(1) drawn as one tensor shaped like `probs` (ATen `multinomial`'s one-sample fast
    path): the shared rows' noise is one [R, V] draw, each seeded row's one [V] draw from its own
    generator, so tokens equal per-row `multinomial` calls while the division and argmax run batched.
    """
    greedy = temperatures == 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    logp = torch.log_softmax(logits / scale[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    all_greedy = bool(greedy.all())
    if not all_greedy:
        probs = logp.exp()
        if bool((top_ks < logits.shape[-1]).any() or (top_ps < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(logits.shape[-1])[None, :]
            cut = (ranks >= top_ks[:, None]) | ((sorted_p.cumsum(-1) - sorted_p) > top_ps[:, None])
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(cut, 0.0))
        shared = ~greedy
        if generators:
            shared[list(generators)] = False
        if bool(shared.all()):
            noise = torch.empty_like(probs).exponential_(generator=shared_generator)
        else:
            noise = torch.ones_like(probs)
            if bool(shared.any()):
                noise[shared] = torch.empty(int(shared.sum()), probs.shape[-1]).exponential_(generator=shared_generator)
            greedy_rows = set(greedy.nonzero()[:, 0].tolist())
            noise_rows = noise.unbind(0)  # views of the rows, made in one call
            for row, generator in generators.items():
                if row not in greedy_rows:
                    noise_rows[row].exponential_(generator=generator)
        tokens = torch.where(greedy, tokens, (probs / noise).argmax(dim=-1))
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


class CPUEngine:
    """Loads an HF checkpoint and generates for queued sequences on a scheduler thread."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        context_length: Optional[int] = None,
        max_running_requests: int = 64,
        random_seed: int = 0,
        weight_version: str = "default",
        batch_wait_s: float = BATCH_WAIT_S,
        lora: Optional[LoraAdapters] = None,
        return_routed_experts: bool = False,
        prefix_sharing: bool = True,
    ):
        """`batch_wait_s`: before starting a batch, wait while requests keep arriving (a burst from
        the client becomes one batch), for at most 20 such periods. The last period is idle time
        of every batch (`BATCH_WAIT_S`); a request that misses it joins the running batch at its
        next decode step. `return_routed_experts`:
        SGLang's `--enable-return-routed-experts` (record the router's choices; MoE models).
        `prefix_sharing`: one prefill per distinct prompt of a batch (this engine's prefix cache;
        SGLang's `--disable-radix-cache` turns it off)."""
        self.model_path = model_path
        self.dtype = resolve_dtype(dtype)
        self.model, self.fp8 = load_served_model(model_path, self.dtype)  # fp8: the block-FP8 weights, if quantized
        self.config = self.model.config
        self.return_routed_experts = return_routed_experts
        self.prefix_sharing = prefix_sharing
        self._route_recorder = RouteRecorder(self.model) if return_routed_experts else None
        self.tokenizer = load_tokenizer_if_present(model_path)
        self.eos_token_ids = eos_token_ids(model_path, self.config)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.context_length = context_length or self.config.max_position_embeddings
        self.max_running_requests = max_running_requests
        self.weight_version = weight_version
        self.lora = lora or LoraAdapters()  # the LoRA adapters served (SGLang's --enable-lora; off by default)
        self.paused = False  # /pause_generation: no batch starts until /continue_generation
        self.released: set[str] = set()
        self.num_finished = 0
        self.last_gen_throughput = 0.0  # generated tokens/s of the last batch
        self.decode_step = 0  # decode steps of the running batch so far (0: idle or prefilling)
        self.num_joined = 0  # sequences that joined a running batch, since start
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self.batch_wait_s = batch_wait_s
        self._shared_generator = torch.Generator().manual_seed(random_seed)
        self._rids = itertools.count()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._model_waiters = 0  # callers of `exclusive_model` waiting or inside: no joins, no new batch
        self._stopped = False
        self._abort_epoch = 0  # bumped by every abort that hits a sequence; the decode loop polls it
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- requests
    def check_prompt(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Refuse what SGLang refuses: over-long prompts or totals, ids outside the vocabulary."""
        if len(prompt_ids) >= self.context_length:
            raise BadRequestError(
                f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        total = len(prompt_ids) + sampling.max_new_tokens
        if total > self.context_length:
            raise BadRequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {total} tokens: {len(prompt_ids)} tokens from the input "
                f"and {sampling.max_new_tokens} tokens for the completion."
            )
        bad = next((i for i, t in enumerate(prompt_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequestError(
                f"input_ids[{bad}] = {prompt_ids[bad]} is outside the vocabulary (size {self.vocab_size})"
            )
        if sampling.stop and self.tokenizer is None:
            raise BadRequestError("sampling_params.stop needs a tokenizer; this model has none (use stop_token_ids)")

    def check_top_logprobs(self, top_logprobs_num: int, sampling: SamplingParams) -> None:
        """Refuse a `top_logprobs_num` (with `return_logprob`) beyond the vocabulary: SGLang 0.5.23's
        scheduler dies on it (`layers/logprob_processor.py::get_top_logprobs_chunk`, `logprobs.topk`:
        "selected index k out of range"); here HTTP 400."""
        if top_logprobs_num > self.vocab_size:
            raise BadRequestError(f"top_logprobs_num={top_logprobs_num} is more than the vocabulary's "
                                  f"{self.vocab_size} tokens")

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise BadRequestError("`text` input needs a tokenizer; this model has none (send input_ids)")
        return list(self.tokenizer(text)["input_ids"])

    def check_can_generate(self) -> None:
        released = self.released & {"weights", "kv_cache"}
        if released:
            raise BadRequestError(
                f"memory {sorted(released)} is released; call /resume_memory_occupation before generating"
            )

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        return_logprob: bool,
        rid: Optional[str],
        on_done: Callable[[Sequence], None],
        lora_name: Optional[str] = None,
        routed_experts_start_len: Optional[int] = None,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> list[Sequence]:
        """Queue the `sampling.n` samples of one prompt; `on_done` is called (scheduler thread) per sample.
        `lora_name`: the LoRA adapter to generate with (SGLang's `lora_path`; None: the base model).
        `routed_experts_start_len`: record routes (None: not asked, or not enabled).
        `logprob_start_len`: with `return_logprob`, the first prompt position of `input_logprobs`
        (-1: the prompt's length, none, as SGLang 0.5.23 `managers/scheduler.py::handle_generate_request`
        sets it; checked by `megarl.rollout.protocol.parse_generate_body`).
        `top_logprobs_num`: with `return_logprob`, the top tokens per position (`check_top_logprobs`)."""
        self.check_can_generate()
        self.check_prompt(prompt_ids, sampling)
        if return_logprob:
            self.check_top_logprobs(top_logprobs_num, sampling)
        lora = self.lora.resolve(lora_name, self.model)
        rid = rid or f"cpu-{next(self._rids)}"
        with self._cond:
            seqs = []
            for j in range(sampling.n):
                seed = None if sampling.sampling_seed is None else sampling.sampling_seed + j
                seqs.append(Sequence(rid, j, list(prompt_ids), sampling, return_logprob, seed, on_done, lora=lora,
                                     routed_experts_start_len=routed_experts_start_len,
                                     logprob_start_len=len(prompt_ids) if logprob_start_len == -1
                                     else logprob_start_len,
                                     top_logprobs_num=max(top_logprobs_num, 0) if return_logprob else 0))
            self._waiting.extend(seqs)
            self._cond.notify()
        return seqs

    @contextmanager
    def submitting(self) -> Iterator[None]:
        """Hold the queue while submitting several prompts (one batched request's): the
        scheduler takes all of them into a batch or none, whatever its `batch_wait_s`."""
        with self._cond:
            yield

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort waiting and running sequences of `rid` (or all); returns how many were hit."""
        with self._cond:
            unfinished = [s for s in list(self._waiting) + self._running if s.finish_reason is None]
            hit = [s for s in unfinished if abort_all or s.rid == rid]
            for seq in hit:
                seq.abort_requested = True
            if hit:
                self._abort_epoch += 1
            waiting = [s for s in self._waiting if s.abort_requested]
            for seq in waiting:
                self._waiting.remove(seq)
            self._cond.notify_all()  # `wait_idle`
        for seq in waiting:
            self._finish(seq, finish_abort("Aborted before the request started running."))
        return len(hit)

    def pause_generation(self, mode: str) -> None:
        """SGLang 0.5.23 `/pause_generation` (`managers/tokenizer_manager.py::pause_generation`):
        mode "abort" aborts every request, running ones return their tokens so far with
        finish_reason abort, and requests sent while paused wait for `continue_generation`;
        weight updates may run meanwhile. SGLang's "retract" and "in_place" keep requests to
        resume them with their KV cache, which this engine does not hold: refused."""
        if mode != "abort":
            raise BadRequestError(f"pause_generation mode {mode!r}: megarl's CPU engine implements 'abort' only")
        with self._cond:
            self.paused = True
        self.abort(abort_all=True)  # wakes `wait_idle`

    def continue_generation(self) -> None:
        """SGLang 0.5.23 `/continue_generation`: waiting requests run again."""
        with self._cond:
            self.paused = False
            self._cond.notify_all()

    def is_idle(self) -> bool:
        """No batch in the scheduler and nothing queued: SGLang 0.5.23's `Scheduler.is_fully_idle`,
        which its `/flush_cache`, weight updates' flush and `/release_memory_occupation` ask. A
        batch counts until the scheduler thread has retired it (`_retire_batch`), also after its
        last answer went out: SGLang's scheduler keeps a finished request in `running_batch` /
        `last_batch` until its next loop (`event_loop_normal`; the overlap loop holds it in
        `result_queue` too), and a release that comes meanwhile ends its server. While paused,
        requests sent since wait outside the scheduler in SGLang (`tokenizer_manager.py`:
        `is_pause_cond`), so they do not count (a weight update may flush the cache then)."""
        with self._cond:
            return self._idle()

    def _idle(self) -> bool:
        """`is_idle`, called holding `_cond`."""
        return not self._running and (self.paused or not self._waiting)

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether the engine is idle (`is_idle`) now or becomes so within `timeout_s` seconds."""
        with self._cond:
            return self._cond.wait_for(self._idle, timeout_s)

    def _retire_batch(self) -> None:
        """The scheduler thread is done with its batch (every sequence of it answered): only now
        may the engine be idle (`is_idle`). Called before the model lock is let go, so that a
        weight update waiting for it finds the engine idle."""
        with self._cond:
            self._running = []
            self.decode_step = 0
            self._cond.notify_all()  # `wait_idle`

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Sequences of the current batch not finished yet."""
        with self._cond:
            return sum(1 for s in self._running if s.finish_reason is None)

    # ---------------------------------------------------------------- memory state
    def release_memory(self, tags: Optional[list[str]]) -> None:
        """SGLang asserts an idle server first: a release with requests running or waiting ends it.
        Any tag is taken (SGLang's `offload_tags.add(tag)`); None or []: all of `MEMORY_TAGS`."""
        if not self.is_idle():
            raise SchedulerCrash("AssertionError: release_memory_occupation should be called only when server is "
                                 f"idle ({self.num_running} running, {self.num_waiting} waiting)")
        self.released |= set(tags or MEMORY_TAGS)

    def resume_memory(self, tags: Optional[list[str]]) -> None:
        """Every tag must be released (SGLang's `offload_tags.remove(tag)`, in the request's order):
        resuming one that is not ends the server, as SGLang's KeyError ends its scheduler."""
        for tag in tags or MEMORY_TAGS:
            if tag not in self.released:
                raise SchedulerCrash(f"KeyError: {tag!r}: resume_memory_occupation of memory that is not released "
                                     f"(released: {sorted(self.released)})")
            self.released.remove(tag)

    # ---------------------------------------------------------------- weights
    @contextmanager
    def exclusive_model(self) -> Iterator[torch.nn.Module]:
        """The model, between batches: while a caller waits here the running batch takes no
        newcomers (so it ends), and no batch starts until the caller is done (weight updates, checksums)."""
        with self._cond:
            self._model_waiters += 1
        try:
            with self._model_lock:
                yield self.model
        finally:
            with self._cond:
                self._model_waiters -= 1
                self._cond.notify_all()

    def _check_weights_resident(self) -> None:
        if "weights" in self.released:
            raise BadRequestError("weights are released; call /resume_memory_occupation with tags ['weights'] first")

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors named as in a checkpoint (per-expert names too, but not gpt-oss's:
        `checkpoint_names`) into the model, cast to its dtype; a quantized model's block-FP8 weights
        come with their scales and are held and dequantized (`Fp8Weights`). All-or-nothing. Returns the count."""
        self._check_weights_resident()
        state = self.model.state_dict()  # detached, sharing the parameters' storage
        count = len(named_tensors)
        fp8_updates = {}
        if self.fp8 is not None:
            named_tensors, fp8_updates = self.fp8.split(named_tensors, state)
        fused = fused_on_disk(self.model)
        targets = [checkpoint_tensor(state, name, fused) for name, _ in named_tensors]
        for (name, tensor), target in zip(named_tensors, targets):
            if target is None:
                raise BadRequestError(f"unknown weight name {name!r} for {type(self.model).__name__}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise BadRequestError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
        with self.exclusive_model(), torch.no_grad():
            for (_, tensor), target in zip(named_tensors, targets):
                target.copy_(tensor)
            if fp8_updates:
                self.fp8.apply(fp8_updates, state)
        return count

    def checked_tensors(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """What `/weights_checker` hashes: the model's tensors under checkpoint names (`model_tensors`),
        block-FP8 weights as SGLang holds them, values and weight_scale_inv (`Fp8Weights.checked_tensors`).
        Call it holding the model (`exclusive_model`)."""
        tensors = model_tensors(model)
        return tensors if self.fp8 is None else self.fp8.checked_tensors(tensors)

    def load_weights_from_disk(self, model_path: str) -> None:
        """Swap in the weights of another checkpoint of the same architecture and quantization (SGLang
        keeps the quantization it started with); the old ones stay on failure."""
        self._check_weights_resident()
        try:
            new_model, new_fp8 = load_served_model(model_path, self.dtype)
        except (OSError, ValueError) as e:
            raise BadRequestError(f"Failed to load weights from {model_path}: {e}") from e
        served = None if self.fp8 is None else self.fp8.quantized
        if served != (None if new_fp8 is None else new_fp8.quantized):
            raise BadRequestError(f"{model_path} is not quantized as the served model is (block FP8 weights: "
                                  f"{'none' if served is None else len(served)} served, "
                                  f"{'none' if new_fp8 is None else len(new_fp8.quantized)} there)")
        old = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        new = {k: tuple(v.shape) for k, v in new_model.state_dict().items()}
        if old != new:
            diff = sorted(set(old.items()) ^ set(new.items()))[:3]
            raise BadRequestError(f"{model_path} does not match the served architecture (first differences: {diff})")
        with self.exclusive_model():
            self.model, self.fp8 = new_model, new_fp8
            self.model_path = model_path
            if self._route_recorder is not None:
                self._route_recorder.remove()
                self._route_recorder = RouteRecorder(new_model)

    # ---------------------------------------------------------------- scheduler
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self.abort(abort_all=True)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._can_start() and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._wait_for_burst()
                if not self._can_start():  # aborted, paused or a weight update came meanwhile
                    continue
                adapter = self._waiting[0].lora  # one LoRA adapter (or none) per forward
                self._running = self._pop_waiting(adapter, self.max_running_requests, stop_at_other=False)
            try:
                with self._model_lock, applied(self.model, adapter):
                    self._run_batch(adapter)
                    self._retire_batch()
            except Exception as e:  # a bug must not kill the server: fail this batch, keep serving
                log.exception("batch failed")
                with self._cond:
                    failed = list(self._running)
                for seq in failed:
                    if seq.finish_reason is None:
                        seq.error = f"{type(e).__name__}: {e}"
                        self._finish(seq, finish_abort(seq.error))
                self._retire_batch()

    def _can_start(self) -> bool:
        """Called holding `_cond`: a batch may start (requests wait, not paused, no weight update waiting)."""
        return bool(self._waiting) and not self.paused and not self._model_waiters

    def _pop_waiting(self, adapter: Optional[LoadedAdapter], limit: int, stop_at_other: bool) -> list[Sequence]:
        """Called holding `_cond`: take up to `limit` waiting sequences of `adapter` (the same object;
        None: the base model), in queue order; with `stop_at_other`, none behind a sequence left waiting."""
        taken, left = [], deque()
        for seq in self._waiting:
            if seq.lora is adapter and len(taken) < limit and not (stop_at_other and left):
                taken.append(seq)
            else:
                left.append(seq)
        self._waiting = left
        return taken

    def _wait_for_burst(self) -> None:
        """Called holding `_cond`: return once the queue stopped growing for `batch_wait_s`."""
        deadline = time.monotonic() + 20 * self.batch_wait_s
        while len(self._waiting) < self.max_running_requests and time.monotonic() < deadline:
            before = len(self._waiting)
            self._cond.wait(self.batch_wait_s)
            if len(self._waiting) == before:
                return

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.finish_reason = reason
        seq.finished_s = time.monotonic()
        if self.tokenizer is not None:
            matched = reason.get("matched")
            # SGLang 0.5.23 leaves a matched stop token (an int) out of the text, and a stop string
            # with what follows it, unless no_stop_trim (`managers/detokenizer_manager.py::trim_matched_stop`)
            trim_token = isinstance(matched, int) and not seq.sampling.no_stop_trim
            ids = seq.output_ids[:-1] if trim_token else seq.output_ids
            seq.text = self.tokenizer.decode(ids, skip_special_tokens=seq.sampling.skip_special_tokens)
            if isinstance(matched, str) and not seq.sampling.no_stop_trim:
                seq.text = seq.text[: seq.text.find(matched)] if matched in seq.text else seq.text
        self.num_finished += 1
        seq.on_done(seq)

    def _finish_reason(self, seq: Sequence, output_ids: list[int], length_done: bool) -> Optional[dict[str, Any]]:
        """SGLang's order: stop string, then stop token / EOS (unless ignore_eos), then length."""
        sp = seq.sampling
        if sp.stop:
            text = self.tokenizer.decode(output_ids, skip_special_tokens=sp.skip_special_tokens)
            for stop in sp.stop:
                if stop in text:
                    return finish_stop(stop)
        last = output_ids[-1]
        if not sp.ignore_eos and (last in sp.stop_token_ids or last in self.eos_token_ids):
            return finish_stop(last)
        if length_done:
            return finish_length(sp.max_new_tokens)
        return None

    def _forward(self, model, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return out.logits[:, -1, :].float()

    def _record_routes(self, active: list[Sequence], input_ids: torch.Tensor, mask: torch.Tensor,
                       row_of: Optional[torch.Tensor] = None) -> None:
        """After a forward on `input_ids` [B, T]: append each asking sequence's routes at its real
        (mask 1) positions of the last T columns. `row_of[i]`: the forward's row of sequence i (a
        shared prefill's distinct prompts; default row i)."""
        if self._route_recorder is None:
            return
        routes = self._route_recorder.take(*input_ids.shape)
        if row_of is not None:
            routes, mask = routes[row_of], mask[row_of]
        real = mask[:, -input_ids.shape[1]:].bool()
        for row, seq in enumerate(active):
            if seq.routed_experts_start_len is not None:
                seq.routes.append(routes[row][real[row]])

    def _score_inputs(self, seq: Sequence) -> None:
        """`seq.input_logprobs` (return_logprob): SGLang's input log-probs of prompt positions
        [logprob_start_len, prompt): None first, then log p(prompt[t] | prompt[:t]) under
        log_softmax(logits), whatever the request's temperature (SGLang 0.5.23
        `layers/logprob_processor.py::InputLogprobProcessor` takes no temperature); none when the
        start is the prompt's length. A forward of its own over the prompt when it covers more
        than the last position. With `top_logprobs_num` k, `seq.input_top_logprobs` likewise (the
        top k of each of those positions' distributions, None first) and `seq.output_top_logprobs`
        the top k after the whole prompt, as SGLang 0.5.23 reports them for max_new_tokens 0
        (`managers/scheduler_components/logprob_result_processor.py::_process_input_top_logprobs`);
        with max_new_tokens > 0 the decode loop adds those of each output token instead
        (`DecodeRows.record_top_logprobs`)."""
        start, ids, k = seq.logprob_start_len, seq.prompt_ids, seq.top_logprobs_num
        seq.input_logprobs = [None] if start < len(ids) else []
        seq.input_top_logprobs = [None] if k > 0 and start < len(ids) else []
        after_prompt = k > 0 and seq.sampling.max_new_tokens == 0
        if start >= len(ids) - 1 and not after_prompt:
            return
        logits = self.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        if self._route_recorder is not None:  # this forward's routes are no generation's
            self._route_recorder.take(1, len(ids))
        logp = torch.log_softmax(logits, dim=-1)  # [prompt, vocab]: row t is the distribution of token t + 1
        seq.input_logprobs += logp[start:-1].gather(-1, torch.tensor(ids[start + 1:])[:, None])[:, 0].tolist()
        if k > 0:
            values, indices = logp.topk(k, dim=-1)
            rows = [list(zip(v, i)) for v, i in zip(values.tolist(), indices.tolist())]
            seq.input_top_logprobs += rows[start:-1]
            if after_prompt:
                seq.output_top_logprobs = rows[-1:]

    def _startable(self, seqs: list[Sequence]) -> list[Sequence]:
        """Finish the sequences aborted while waiting and those with max_new_tokens 0 (after scoring
        the inputs of those that return log-probs); return the rest."""
        rest = []
        for seq in seqs:
            if seq.abort_requested:
                self._finish(seq, finish_abort("Aborted before the request started running."))
                continue
            if seq.return_logprob:
                self._score_inputs(seq)
            if seq.sampling.max_new_tokens == 0:
                self._finish(seq, finish_length(0))
            else:
                rest.append(seq)
        return rest

    def _prefill(self, model, seqs: list[Sequence], extra_columns: int) -> tuple[DecodeRows, Any, torch.Tensor]:
        """One forward over the prompts left-padded; returns (rows, a KV cache of the prompt width
        plus `extra_columns`, logits [B, V] of each row's last prompt token)."""
        rows = DecodeRows.for_prompts(seqs, self.vocab_size, self.eos_token_ids)
        input_ids, mask = rows.prompt_ids(), rows.attention_mask(rows.length)
        cache = preallocated_cache(self.config, rows.length + extra_columns)
        # each distinct prompt once (a request's n samples share it, as in SGLang's prefix cache),
        # its keys, values and logits then copied to its samples' rows
        shared = False
        if self.prefix_sharing and is_preallocated(cache):
            distinct, row_of = torch.unique(torch.cat([input_ids, mask], dim=1), dim=0, return_inverse=True)
            shared = len(distinct) < len(seqs)  # else nothing to share: no copy of the cache
            if shared:
                input_ids, mask = distinct[:, :rows.length], distinct[:, rows.length:]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(model, input_ids, mask, positions, cache)
        if shared:
            gather_rows(cache, row_of)
            logits = logits[row_of]
        self._record_routes(seqs, input_ids, mask, row_of if shared else None)
        return rows, cache, logits

    def _join(self, model, adapter: Optional[LoadedAdapter], rows: DecodeRows, cache, logits: torch.Tensor) -> torch.Tensor:
        """Admit waiting sequences of `adapter` into the running batch (room permitting): prefill them,
        append their KV rows to `cache` and their rows to `rows`; returns `logits` with theirs below."""
        if not self._waiting:  # the common case, without taking the lock
            return logits
        with self._cond:
            if self.paused or self._model_waiters or self._stopped:
                return logits
            joiners = self._pop_waiting(adapter, self.max_running_requests - len(rows), stop_at_other=True)
            self._running.extend(joiners)
        joiners = self._startable(joiners)
        if not joiners:
            return logits
        new_rows, new_cache, new_logits = self._prefill(model, joiners, 0)
        capacity = max(rows.length, new_rows.length) + max(rows.remaining(), new_rows.remaining())
        append_rows(cache, new_cache, capacity)
        rows.extend(new_rows)
        self.num_joined += len(joiners)
        return torch.cat([logits, new_logits])

    @torch.no_grad()
    def _run_batch(self, adapter: Optional[LoadedAdapter]) -> None:
        """Prefill the batch in `_running` left-padded, then decode one token for every row per step,
        admitting newcomers between steps (`_join`).

        The KV cache is preallocated for the longest prompt plus the largest `max_new_tokens`, and
        reallocated when newcomers join; each step is one forward over [B, 1] tokens (forward hooks
        see every step), one batched sample, and tensor checks for stop ids and lengths. Python
        touches a row only when it finishes, is aborted, has stop strings, asks for top log-probs, or
        has its own seed (its generator draws per step). Finished rows leave the cache; tokens and log-probs are copied to
        the `Sequence` when it finishes.
        """
        abort_epoch = self._abort_epoch
        active = self._startable(list(self._running))
        if not active:
            return
        started = time.monotonic()
        model = self.model
        rows, cache, logits = self._prefill(model, active, max(s.sampling.max_new_tokens for s in active))
        joinable = can_append_rows(cache)  # other cache layer kinds (sliding windows): no newcomers
        generated, step = 0, 0
        while True:
            tokens, logprobs = sample_tokens(logits, rows.temperatures, rows.top_ps, rows.top_ks, rows.generators,
                                             self._shared_generator)
            rows.record(tokens, logprobs)
            if rows.top_rows:
                rows.record_top_logprobs(logits)
            step = self.decode_step = step + 1
            ended = rows.max_new <= rows.counts
            if rows.stop_ids is not None:
                ended |= (tokens[:, None] == rows.stop_ids).any(dim=-1)
            ended_rows = set(ended.nonzero()[:, 0].tolist()) if bool(ended.any()) else set()
            for row in rows.string_rows:
                if row not in ended_rows and self._finish_reason(rows.seqs[row], rows.token_ids(row), False):
                    ended_rows.add(row)
            aborted_rows = set()
            if self._abort_epoch != abort_epoch:  # an /abort_request since the last look: find its rows
                abort_epoch = self._abort_epoch
                aborted_rows = {r for r, s in enumerate(rows.seqs) if s.abort_requested}
            generated += len(rows) - len(aborted_rows)
            finished = sorted(ended_rows | aborted_rows)
            for row, (ids, logprobs) in zip(finished, rows.outputs(finished, drop_last=aborted_rows)):
                seq = rows.seqs[row]
                aborted = row in aborted_rows  # an aborted row drops this step's token
                seq.output_ids = ids
                if seq.return_logprob:
                    seq.logprobs = logprobs
                if aborted and seq.output_top_logprobs:
                    seq.output_top_logprobs.pop()  # this step's, with its token
                if aborted:
                    self._finish(seq, finish_abort("Aborted by /abort_request while running."))
                else:
                    self._finish(seq, self._finish_reason(seq, seq.output_ids,
                                                          len(seq.output_ids) >= seq.sampling.max_new_tokens))
            if ended_rows or aborted_rows:
                keep = [r for r in range(len(rows)) if r not in ended_rows and r not in aborted_rows]
                if not keep:
                    break
                cache.batch_select_indices(torch.tensor(keep))
                rows.keep(keep)
                tokens = tokens[keep]
            mask = rows.attention_mask(rows.length + 1)
            logits = self._forward(model, tokens[:, None], mask, rows.next_pos, cache)
            self._record_routes(rows.seqs, tokens[:, None], mask)
            rows.fed()
            if joinable:
                logits = self._join(model, adapter, rows, cache, logits)
        self.last_gen_throughput = generated / max(time.monotonic() - started, 1e-9)
