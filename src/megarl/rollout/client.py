"""The rollout client: many `/generate` requests in flight against an SGLang-protocol endpoint.

The endpoint is an `sglang-router` or a single server (real SGLang or megarl's CPU engine). Each
prompt is one request with `sampling_params.n` samples, so SGLang shares the prompt's prefill (with
`batch_per_server`, each server's prompts are one batched request, sent to it straight). The
client keeps at most `max_concurrency` requests in flight, retries connection errors, timeouts and
5xx answers with exponential backoff, and fails fast on a 4xx, naming the prompt index. `abort()`
(from any thread) stops what is queued and asks the servers to abort what is running; the partial
samples come back with finish reason "abort".

    with RolloutClient(router.url, abort_urls=router.worker_urls()) as client:
        result = client.generate(prompts, SamplingParams(max_new_tokens=256, temperature=1.0, n=8))
    result.samples[i][j].token_ids, .logprobs, .finish_reason;  result.metrics.as_dict()

The client keeps one event loop (a daemon thread, `LoopThread`) and one aiohttp session with its
keep-alive connections for its life, from the first call to `close()`: `generate` from any
thread and `agenerate` from any event loop run there, not a loop and a connection per request.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import aiohttp

from megarl.rollout.control import ServerControl, ServerError
from megarl.rollout.loop_thread import LoopThread
from megarl.rollout.metrics import RequestRecord, RolloutMetrics, summarize
from megarl.rollout.protocol import SamplingParams, error_message
from megarl.rollout.routed_experts import decode_routed_experts, narrow_routes

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Idle keep-alive connections are closed by the client after this long (s): below uvicorn's
# `timeout_keep_alive` (5 s by default; the CPU engine's HTTP server, and SGLang's), so the client
# does not reuse a connection the server is closing at that moment.
KEEPALIVE_S = 4.0


@dataclass(frozen=True)
class Sample:
    """One generated response. `logprobs[t]` is the log-prob of `token_ids[t]` (None if not asked)."""

    token_ids: list[int]
    logprobs: Optional[list[float]]
    finish_reason: str  # "stop" | "length" | "abort"
    matched: int | str | None  # the stop token id or stop string, for "stop"
    text: str
    weight_version: Optional[str]
    weight_versions: Optional[list[str]] = None  # per token, for a partial rollout continued across versions
    # routing replay: [prompt + len(token_ids) - 1, layers, top_k], the experts every input position
    # was routed to (SGLang's rows, megarl.rollout.routed_experts), int32 as on the wire or narrowed
    # to `route_dtype(num_experts)`; None if not asked
    routed_experts: Any = None

    @classmethod
    def from_sglang(cls, output: dict[str, Any], routes_shape: Optional[tuple[int, int, int]] = None,
                    num_experts: Optional[int] = None) -> Sample:
        """`routes_shape`: (rows, layers, top_k) of the routed experts asked for (None: not asked);
        with `num_experts` they are narrowed (`narrow_routes`), else int32 as SGLang sends them."""
        meta = output["meta_info"]
        finish = meta.get("finish_reason") or {}
        entries = meta.get("output_token_logprobs")
        token_ids = list(output["output_ids"])
        if entries is not None and [e[1] for e in entries] != token_ids:
            raise ValueError(f"output_token_logprobs ids {[e[1] for e in entries]} differ from output_ids {token_ids}")
        return cls(
            token_ids=token_ids,
            logprobs=[float(e[0]) for e in entries] if entries is not None else None,
            finish_reason=finish.get("type", "unknown"),
            matched=finish.get("matched"),
            text=output.get("text") or "",
            weight_version=meta.get("weight_version"),
            routed_experts=_routes(meta, routes_shape, num_experts),
        )

    @classmethod
    def aborted(cls) -> Sample:
        return cls([], [], "abort", None, "", None)


def _routes(meta: dict[str, Any], shape: Optional[tuple[int, int, int]], num_experts: Optional[int]):
    if shape is None or shape[0] <= 0:
        return None
    if "routed_experts" not in meta:
        if (meta.get("finish_reason") or {}).get("type") == "abort":
            return None  # aborted before it ran
        raise ValueError("the server returned no routed_experts (start SGLang with --enable-return-routed-experts)")
    routes = decode_routed_experts(meta["routed_experts"], shape[0]).reshape(shape)
    return routes if num_experts is None else narrow_routes(routes, num_experts)


@dataclass(frozen=True)
class RolloutResult:
    samples: list[list[Sample]]  # [prompt][sample], n per prompt, in request order ([] for a failed prompt)
    metrics: RolloutMetrics
    records: list[RequestRecord]  # per prompt, in request order
    failed: dict[int, str] = field(default_factory=dict)  # prompt index -> why it got no answer (keep_going)


def stale_reason(samples: list[Sample], weight_version: Optional[str],
                 earlier: Sequence[Optional[str]] = ()) -> Optional[str]:
    """Why a prompt's samples may not be kept: one token was generated with weights other than
    `weight_version` or `earlier` (versions pushed while they generated: partial rollouts).
    None among them: nothing pushed yet, any version goes. Aborted samples carry none."""
    if weight_version is None or None in earlier:
        return None
    ok = {weight_version, *earlier}
    for s in samples:  # every token's version: a partial rollout's earlier parts too
        wrong = [v for v in dict.fromkeys(s.weight_versions or [s.weight_version]) if v not in ok]
        if s.finish_reason != "abort" and wrong:
            expected = repr(weight_version) if not earlier else f"one of {sorted(ok)}"
            return f"answered with weight_version {wrong[0]!r}, expected {expected}"
    return None


class RolloutRequestError(RuntimeError):
    """A prompt's request that was refused (4xx) or failed after all retries."""

    def __init__(self, prompt_index: int, status: Optional[int], message: str):
        self.prompt_index, self.status = prompt_index, status
        where = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"prompt {prompt_index}: {where}: {message}")


class _Retry(Exception):
    """An attempt that may succeed if repeated."""


class RolloutClient:
    def __init__(
        self,
        url: str,
        *,
        api_key: Optional[str] = None,
        max_concurrency: int = 256,
        request_timeout_s: float = 3600.0,
        max_retries: int = 5,
        retry_backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        abort_urls: Optional[list[str]] = None,
        continue_aborted: bool = False,
        routed_experts: Optional[tuple[int, int, int]] = None,
        server_urls: Optional[list[str]] = None,
        batch_per_server: bool = False,
        vocab_size: Optional[int] = None,
    ):
        """`routed_experts`: (layers, top_k, num_experts) of an MoE model whose routes every sample
        brings back, narrowed (routing replay; the servers run with `--enable-return-routed-experts`). `server_urls`:
        send prompt i's requests to server i % len straight, not through `url`: sglang-router
        0.3.2 (the newest) drops `return_routed_experts` from the requests it forwards (its
        GenerateRequest has no such field), so routing replay goes around it.
        `batch_per_server` (with `server_urls`, without routing replay): the prompts of a
        `generate` that go to one server go in one batched `/generate` (SGLang's list of prompts
        with a list of `sampling_params`; at most `max_concurrency` prompts a request) rather than
        one request each: a step sends one request per server instead of one per prompt. The
        router cannot carry such a batch: its GenerateRequest takes one `sampling_params` for all
        prompts, which cannot hold each prompt's `sampling_seed`. A batch is retried, refused or
        lost as a whole, and each of its prompts' records has the batch's latency and attempts.
        `abort_urls`: the servers `abort()` tells to stop (behind a router: its workers; default `url`).
        `continue_aborted` (partial rollouts): a sample the server aborted (`/pause_generation`)
        is continued from its tokens instead of generated again (`_continue`).
        `vocab_size`: the served model's (its HF config's), which `score` needs to read the token
        ids SGLang reports (`reported_input_id_matches`); None: `score` refuses to run."""
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_backoff_s = max_backoff_s
        self.abort_urls = abort_urls or [self.url]
        self.continue_aborted = continue_aborted
        self.lora_name: Optional[str] = None  # adapter-only LoRA sync: the adapter every request names
        self.routed_experts = routed_experts
        self.server_urls = server_urls or []  # the fleet's own list: a restarted server's new URL shows
        if batch_per_server and (not self.server_urls or routed_experts is not None):
            raise ValueError("batch_per_server needs server_urls and no routed_experts (each prompt's routes are "
                             "read against its own request)")
        self.batch_per_server = batch_per_server
        self.vocab_size = vocab_size
        self._aborting = threading.Event()
        self._lock = threading.Lock()  # guards `_loop`
        self._loop: Optional[LoopThread] = None  # started by the first call
        self._session: Optional[aiohttp.ClientSession] = None  # made and used on `_loop` only

    # ---------------------------------------------------------------- public API
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, return_logprob: bool = True,
        seeds: Optional[list[int]] = None, keep_going: bool = False,
    ) -> RolloutResult:
        """Blocking form of `agenerate`, from any thread (not from inside `agenerate`)."""
        return self._loop_thread().run(self._generate(prompts, sampling, return_logprob, seeds, keep_going))

    async def agenerate(
        self, prompts: list[list[int]], sampling: SamplingParams, return_logprob: bool = True,
        seeds: Optional[list[int]] = None, keep_going: bool = False,
    ) -> RolloutResult:
        """Generate `sampling.n` samples for every prompt (token ids); every prompt gets exactly n back.
        A prompt that gets no answer after all retries raises `RolloutRequestError`, or with
        `keep_going` comes back in `failed` with no samples while the others finish (a refused
        request, 4xx, raises either way).
        `seeds[i]` is prompt i's `sampling_seed` (its sample j uses seeds[i] + j): the same seeds
        give the same samples whichever server answers and however requests are batched.
        Awaitable from any event loop: the requests run on the client's own."""
        loop = self._loop_thread()
        coroutine = self._generate(prompts, sampling, return_logprob, seeds, keep_going)
        return await (coroutine if loop.in_loop() else loop.wrap(coroutine))

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[list[float]]:
        """A teacher's scores (on-policy distillation): for sequence i, the log-probs of its tokens
        at positions starts[i] + 1 .. end, each given the tokens before it, under softmax(logits)
        (SGLang's input log-probs: `return_logprob`, `logprob_start_len` = starts[i], `max_new_tokens`
        0; `input_log_probs`). Temperature 1 only: SGLang 0.5.23 takes a plain log_softmax of the
        logits for input tokens whatever the request's temperature (`srt/layers/logprob_processor.py`,
        `InputLogprobProcessor._forward_by_chunk`); the request says 1. Needs the client's
        `vocab_size`. Retries and refusals as `generate` (`RolloutRequestError` names the
        sequence's index); blocking, from any thread."""
        if len(starts) != len(sequences):
            raise ValueError(f"starts has {len(starts)} entries for {len(sequences)} sequences")
        if self.vocab_size is None:
            raise ValueError("score needs the served model's vocab_size (RolloutClient(vocab_size=...)) to read "
                             "the token ids SGLang reports")
        return [scores for scores, _, _ in self._loop_thread().run(self._score(sequences, starts, 0))]

    def score_top_k(self, sequences: list[list[int]], starts: list[int],
                    k: int) -> list[tuple[list[float], list[list[float]], list[list[int]]]]:
        """`score`, and the teacher's k most likely tokens at each of those positions: per sequence
        (log-probs [n], top log-probs [n][k] descending, top token ids [n][k]) for its n = len - starts[i] - 1
        scored tokens, row t the distribution of token starts[i] + 1 + t (SGLang's
        `top_logprobs_num` = k: `input_top_log_probs`). 1 <= k <= the served vocabulary."""
        if not 1 <= k <= (self.vocab_size or 0):
            raise ValueError(f"score_top_k: k={k} must be in [1, vocab_size={self.vocab_size}] (SGLang's scheduler "
                             "dies on a top_logprobs_num over the vocabulary)")
        if len(starts) != len(sequences):
            raise ValueError(f"starts has {len(starts)} entries for {len(sequences)} sequences")
        return self._loop_thread().run(self._score(sequences, starts, k))

    def close(self) -> None:
        """Cancel what still runs, close the session and stop the client's loop thread. A later
        call starts them again."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close(self._close_session)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop_thread(self) -> LoopThread:
        with self._lock:
            if self._loop is None:
                self._loop = LoopThread("megarl-rollout-client")
            return self._loop

    def _session_here(self) -> aiohttp.ClientSession:
        """The client's session, made on first use (on the client's loop, whose it is). No
        connection limit: each call's semaphore bounds its own requests, as before. Every request
        carries the client's API key and `request_timeout_s`."""
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S), headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
        return self._session

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _generate(
        self, prompts: list[list[int]], sampling: SamplingParams, return_logprob: bool,
        seeds: Optional[list[int]], keep_going: bool,
    ) -> RolloutResult:
        """`agenerate`, on the client's loop."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        per_prompt = [sampling if seeds is None else replace(sampling, sampling_seed=int(seeds[i]))
                      for i in range(len(prompts))]
        self._aborting.clear()
        started = time.monotonic()
        semaphore = asyncio.Semaphore(self.max_concurrency)
        session = self._session_here()
        groups = self._request_groups(len(prompts))
        tasks = [
            asyncio.create_task(self._generate_group(
                session, semaphore, group, [prompts[i] for i in group], [per_prompt[i] for i in group],
                return_logprob, keep_going))
            for group in groups
        ]
        try:
            answers = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        results: list = [None] * len(prompts)
        for group, answer in zip(groups, answers):
            for i, result in zip(group, answer):
                results[i] = result
        samples, records = [s for s, _, _ in results], [r for _, r, _ in results]
        failed = {i: why for i, (_, _, why) in enumerate(results) if why is not None}
        return RolloutResult(samples, summarize(records, time.monotonic() - started), records, failed)

    def abort(self) -> None:
        """Stop the running rollout: queued prompts are not sent, running requests are aborted."""
        self._aborting.set()
        for url in self.abort_urls:
            try:
                ServerControl(url, self.api_key, timeout_s=30).abort_all()
            except ServerError:
                pass  # a server that cannot be reached has nothing running for us

    async def _score(self, sequences: list[list[int]], starts: list[int], k: int):
        """`score_top_k` (k > 0) or `score` (k = 0: the top lists empty), on the client's loop."""
        sampling = SamplingParams(max_new_tokens=0)
        semaphore, session = asyncio.Semaphore(self.max_concurrency), self._session_here()

        async def one(index: int):
            ids, start = list(sequences[index]), starts[index]
            payload = {**self._payload(ids, sampling, True), "logprob_start_len": start}
            if k > 0:
                payload["top_logprobs_num"] = k
            async with semaphore:
                for attempt in range(1, self.max_retries + 2):
                    try:
                        (output,) = await self._attempt(session, index, payload, 1, as_sent=True)
                        values, top_ids = input_top_log_probs(output, ids, start, k, index) if k else ([], [])
                        return input_log_probs(output, ids, start, self.vocab_size, index), values, top_ids
                    except _Retry as e:
                        if attempt > self.max_retries:
                            raise RolloutRequestError(index, None, f"gave up after {attempt} attempts: {e}") from None
                        await asyncio.sleep(min(self.max_backoff_s, self.retry_backoff_s * 2 ** (attempt - 1)))

        tasks = [asyncio.create_task(one(i)) for i in range(len(sequences))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # ---------------------------------------------------------------- one request
    def _request_groups(self, count: int) -> list[list[int]]:
        """The prompt indices of each request: one prompt each, or with `batch_per_server` the
        prompts of each server (prompt i goes to server i % servers, as `_attempt` sends them) in
        requests of at most `max_concurrency` prompts."""
        if not self.batch_per_server:
            return [[i] for i in range(count)]
        servers, size = len(self.server_urls), self.max_concurrency
        mine = [list(range(s, count, servers)) for s in range(servers)]
        return [prompts[k:k + size] for prompts in mine for k in range(0, len(prompts), size)]

    def _payload(self, input_ids: list[int], sampling: SamplingParams, return_logprob: bool,
                 routed_experts_start_len: Optional[int] = None) -> dict[str, Any]:
        """A `/generate` body for one prompt: with the LoRA adapter to generate with (SGLang's
        `lora_path`, an adapter name) if any, and with routing replay the request for routed
        experts (from position `routed_experts_start_len`, if given)."""
        payload = {"input_ids": input_ids, "sampling_params": sampling.to_json(), "return_logprob": return_logprob}
        if self.lora_name is not None:
            payload["lora_path"] = self.lora_name
        if self.routed_experts is not None:
            payload["return_routed_experts"] = True
            if routed_experts_start_len is not None:
                payload["routed_experts_start_len"] = routed_experts_start_len
        return payload

    async def _generate_group(
        self,
        session: aiohttp.ClientSession,
        semaphore: asyncio.Semaphore,
        indices: list[int],
        prompts: list[list[int]],
        samplings: list[SamplingParams],
        return_logprob: bool,
        keep_going: bool,
    ) -> list[tuple[list[Sample], RequestRecord, Optional[str]]]:
        """One request for prompts `indices` (one, or a batch to one server: `_request_groups`);
        per prompt (samples, record, None), or with `keep_going` ([], record, why) for prompts that
        got no answer."""
        if len(prompts) == 1:
            payload = self._payload(list(prompts[0]), samplings[0], return_logprob)
        else:  # SGLang's batch: a list of prompts, one sampling_params each; the answer prompt-major
            payload = {"input_ids": [list(p) for p in prompts], "sampling_params": [s.to_json() for s in samplings],
                       "return_logprob": return_logprob}
            if self.lora_name is not None:
                payload["lora_path"] = self.lora_name
        counts = [s.n for s in samplings]
        attempts = 0
        async with semaphore:
            while True:
                if self._aborting.is_set():
                    return [([Sample.aborted() for _ in range(n)], RequestRecord(len(p), (0,) * n, 0.0, attempts, n),
                             None) for p, n in zip(prompts, counts)]
                attempts += 1
                sent = time.monotonic()
                try:
                    outputs = await self._attempt(session, indices[0], payload, sum(counts), batch=indices)
                    ends = list(itertools.accumulate(counts))
                    per_prompt = [outputs[end - n:end] for end, n in zip(ends, counts)]
                    retried = [0] * len(prompts)  # continuations sent again, per prompt
                    if self.continue_aborted:
                        for k, (index, prompt, sampling) in enumerate(zip(indices, prompts, samplings)):
                            continued = [await self._continue(session, index, prompt, sampling, j, s, return_logprob)
                                         for j, s in enumerate(per_prompt[k])]
                            per_prompt[k] = [s for s, _ in continued]
                            retried[k] = sum(failed for _, failed in continued)
                except _Retry as e:
                    if attempts > self.max_retries:
                        why = f"gave up after {attempts} attempts: {e}"
                        if keep_going:
                            return [([], RequestRecord(len(p), (), 0.0, attempts, 0), why) for p in prompts]
                        raise RolloutRequestError(indices[0], None, why) from None
                    await asyncio.sleep(min(self.max_backoff_s, self.retry_backoff_s * 2 ** (attempts - 1)))
                    continue
                latency = time.monotonic() - sent
                return [(samples, RequestRecord(
                    prompt_tokens=len(prompt),
                    response_tokens=tuple(len(s.token_ids) for s in samples),
                    latency_s=latency,
                    attempts=attempts + extra,
                    aborted_samples=sum(s.finish_reason == "abort" for s in samples),
                ), None) for prompt, samples, extra in zip(prompts, per_prompt, retried)]

    async def _attempt(
        self, session: aiohttp.ClientSession, index: int, payload: dict[str, Any], n: int, as_sent: bool = False,
        batch: Optional[list[int]] = None,
    ) -> list[Sample] | list[dict[str, Any]]:
        """The `n` samples of one request for prompt `index` (`as_sent`: the server's output dicts
        as they came); of a batch, those of prompts `batch` (`index` its first), prompt-major."""
        url = self.server_urls[index % len(self.server_urls)] if self.server_urls else self.url
        # a refusal of a batch names its prompts (the server numbers them from 0 within it)
        sent_with = f"in the batched request of prompts {batch}: " if batch is not None and len(batch) > 1 else ""
        try:
            async with session.post(url + "/generate", json=payload) as resp:
                status, raw = resp.status, await resp.read()
        except TimeoutError:  # the session's total timeout: connecting, sending and reading, together
            raise _Retry(f"no answer within request_timeout_s={self.request_timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        if status != 200:  # the body's text only for an error: an answer's would cost more than parsing it
            message = error_message(body, str(body)[:500] if body else "(empty body)")
            if status in RETRYABLE_STATUS:
                raise _Retry(f"HTTP {status}: {message}")
            raise RolloutRequestError(index, status, sent_with + message)
        outputs = body if isinstance(body, list) else [body]
        if len(outputs) != n:
            raise RolloutRequestError(index, status, f"{sent_with}expected {n} outputs, got {len(outputs)}")
        if as_sent:
            return outputs
        experts = None if self.routed_experts is None else self.routed_experts[2]
        samples = [Sample.from_sglang(o, self._routes_shape(payload, o), experts) for o in outputs]
        aborts = [o["meta_info"]["finish_reason"] for o, s in zip(outputs, samples) if s.finish_reason == "abort"]
        if aborts and not self._aborting.is_set():
            status_code = aborts[0].get("status_code")
            if status_code is not None and 400 <= status_code < 500:
                raise RolloutRequestError(index, status_code, sent_with + aborts[0].get("message", "aborted"))
            if not self.continue_aborted:
                raise _Retry(f"aborted by the server: {aborts[0].get('message')}")  # not ours: regenerate
        return samples

    def _routes_shape(self, payload: dict[str, Any], output: dict[str, Any]) -> Optional[tuple[int, int, int]]:
        """(rows, layers, top_k) of an answer's routes: positions [start_len, input + output - 1)."""
        if self.routed_experts is None:
            return None
        rows = len(payload["input_ids"]) + len(output["output_ids"]) - 1 - payload.get("routed_experts_start_len", 0)
        return (rows, *self.routed_experts[:2])

    async def _continue(self, session: aiohttp.ClientSession, index: int, prompt: list[int],
                        sampling: SamplingParams, j: int, sample: Sample, return_logprob: bool) -> tuple[Sample, int]:
        """Partial rollouts (as AReaL and verl do it over SGLang): sample `j`, aborted by a pause, is
        sent again as prompt + its tokens for the tokens it still lacks; the request waits at the
        server until `/continue_generation`, so the rest comes from the weights pushed meanwhile.
        Log-probs are each token's own, from the weights that sampled it; `weight_versions` holds
        each token's version when they differ (`weight_version`: the last part's).
        A continuation lost with its server (dead during the push) is sent again, from the same
        tokens, up to `max_retries` times; past them the prompt is generated again from scratch.
        Returns (the sample, the continuation attempts that failed)."""
        versions = [sample.weight_version] * len(sample.token_ids)
        retries = 0
        while sample.finish_reason == "abort" and not self._aborting.is_set():
            left = sampling.max_new_tokens - len(sample.token_ids)
            if left <= 0:
                break
            seed = None if sampling.sampling_seed is None else sampling.sampling_seed + j
            input_ids = list(prompt) + list(sample.token_ids)
            start = 0 if sample.routed_experts is None else len(input_ids) - 1  # the positions not routed yet
            payload = self._payload(input_ids, replace(sampling, n=1, max_new_tokens=left, sampling_seed=seed),
                                    return_logprob, routed_experts_start_len=start)
            try:
                (part,) = await self._attempt(session, index, payload, 1)
            except _Retry:
                retries += 1
                if retries > self.max_retries:
                    raise
                await asyncio.sleep(min(self.max_backoff_s, self.retry_backoff_s * 2 ** (retries - 1)))
                continue
            versions += [part.weight_version] * len(part.token_ids)
            logprobs = None if sample.logprobs is None or part.logprobs is None else sample.logprobs + part.logprobs
            routes = _concat_routes(sample.routed_experts, part.routed_experts)
            sample = Sample(sample.token_ids + part.token_ids, logprobs, part.finish_reason, part.matched,
                            sample.text + part.text, part.weight_version, routed_experts=routes)
        return (replace(sample, weight_versions=versions) if len(set(versions)) > 1 else sample), retries


def reported_input_id_matches(reported: int, sent: int, vocab_size: int) -> bool:
    """Whether `reported`, an entry's token id in `input_token_logprobs`, stands for input token
    `sent`: the same id, or 0 where `sent` >= vocab_size - 1, as SGLang 0.5.23 reports those
    (`srt/managers/scheduler_components/logprob_result_processor.py`,
    `SchedulerLogprobResultProcessor._process_input_token_logprobs` clips what it takes for padded
    image-token hashes; its `vocab_size` is the served model's `ModelConfig.vocab_size`, the HF
    config's). Output token ids are reported as sampled."""
    return reported == sent or (reported == 0 and sent >= vocab_size - 1)


def input_log_probs(output: dict[str, Any], ids: list[int], start: int, vocab_size: int,
                    index: int = 0) -> list[float]:
    """The log-probs of ids[start + 1:] from one `/generate` answer's `meta_info.input_token_logprobs`
    (entries [logprob, token_id, text] for ids[start:], the first logprob null, as SGLang sends
    them; each token_id as `reported_input_id_matches` allows for the served model's `vocab_size`).
    Raises `RolloutRequestError` (naming sequence `index`) when the entries are missing or do not
    match `ids`."""
    entries = output.get("meta_info", {}).get("input_token_logprobs")
    sent = ids[start:]
    if entries is None or len(entries) != len(sent) or not all(
            reported_input_id_matches(e[1], i, vocab_size) for e, i in zip(entries, sent)):
        got = "none" if entries is None else f"ids {[e[1] for e in entries][:8]}..."
        raise RolloutRequestError(index, 200, f"input_token_logprobs: {got}, expected one entry for each of the "
                                  f"{len(ids) - start} input tokens from logprob_start_len={start}")
    if entries and entries[0][0] is not None:
        raise RolloutRequestError(index, 200, "input_token_logprobs[0] has a log-prob; SGLang sends null there")
    return [float(e[0]) for e in entries[1:]]


def input_top_log_probs(output: dict[str, Any], ids: list[int], start: int, k: int,
                        index: int = 0) -> tuple[list[list[float]], list[list[int]]]:
    """(log-probs [n][k], token ids [n][k]) of the k most likely tokens at the n = len(ids) - start - 1
    positions whose tokens are ids[start + 1:], from one `/generate` answer's `meta_info.input_top_logprobs`
    (top_logprobs_num = k: null for ids[start], then per position k entries [logprob, token_id, text]
    in descending order, the ids unclipped: SGLang 0.5.23 `managers/scheduler_components/
    logprob_result_processor.py::_process_input_top_logprobs`, `managers/tokenizer_manager.py::
    detokenize_top_logprobs_tokens`). Raises `RolloutRequestError` (naming sequence `index`) when
    the entries are missing or of another shape."""
    rows = output.get("meta_info", {}).get("input_top_logprobs")
    expected = len(ids) - start
    if rows is None or len(rows) != expected or (rows and rows[0] is not None) or not all(
            row is not None and len(row) == k for row in rows[1:]):
        got = "none" if rows is None else f"{len(rows)} rows, sizes {[None if r is None else len(r) for r in rows][:8]}"
        raise RolloutRequestError(index, 200, f"input_top_logprobs: {got}, expected null then {expected - 1} rows of "
                                  f"top_logprobs_num={k} entries from logprob_start_len={start}")
    return [[float(e[0]) for e in row] for row in rows[1:]], [[int(e[1]) for e in row] for row in rows[1:]]


def _concat_routes(first, rest):
    """A partial rollout's routes: the first part's, then the continuation's (None: none yet)."""
    import torch

    if first is None or rest is None:
        return rest if first is None else first
    return torch.cat([first, rest])
