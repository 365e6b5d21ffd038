"""megarl's OpenAI-compatible endpoint in front of the rollout servers (FastAPI + uvicorn).

    endpoint = OpenAIEndpoint(generate, tokenizer, SamplingDefaults(max_new_tokens=256), recorder)
    endpoint.start()                       # serves on a thread; binds 127.0.0.1 unless `host` says otherwise
    AsyncOpenAI(base_url=endpoint.base_url, api_key="megarl")
    endpoint.stop()

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (both with `stream`), `GET /v1/models`,
`GET /health`. Each call is tokenised with the policy tokenizer, generated token-in/token-out by
`generate(prompt_ids, sampling) -> Sample` (the rollout client), and, when it carries a trajectory
id, recorded in the `TrajectoryRecorder` (exact prompt ids, sampled ids, their log-probs) and
sampled with the trajectory's own `SamplingDefaults` when it was opened with some.
Streaming sends the answer as OpenAI chunks once it is generated (the rollout protocol answers
whole samples). Bad requests get HTTP 400 with an OpenAI error body; a call beyond an episode's
limit gets 400 with code `episode_limit`; a rollout failure gets 502.
"""
from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Awaitable, Callable, Mapping, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from megarl.agents.openai_api import (
    TRAJECTORY_FIELD,
    TRAJECTORY_HEADER,
    Completion,
    CompletionRequest,
    OpenAIRequestError,
    SamplingDefaults,
    completion_text,
    error_body,
    parse_chat_request,
    parse_completion_request,
    response_body,
    stream_chunks,
)
from megarl.agents.records import CallRecord, EpisodeLimitError, TrajectoryRecorder, UnknownTrajectoryError
from megarl.rollout.client import RolloutRequestError, Sample
from megarl.rollout.protocol import SamplingParams

GenerateFn = Callable[[list[int], SamplingParams], Awaitable[Sample]]


def build_app(generate: GenerateFn, tokenizer, defaults: SamplingDefaults,
              recorder: Optional[TrajectoryRecorder] = None, model_name: str = "policy",
              chat_template_kwargs: Optional[Mapping[str, Any]] = None) -> FastAPI:
    """The FastAPI app; calls tagged with a trajectory id need `recorder`; `chat_template_kwargs`:
    the chat template's variables of every chat call (a call's own override them)."""
    app = FastAPI(title="megarl OpenAI-compatible endpoint")

    def error(status: int, message: str, kind: str, param=None, code=None) -> JSONResponse:
        return JSONResponse(error_body(message, kind, param, code), status_code=status)

    def sampling_of(body, header: Optional[str]) -> SamplingDefaults:
        """The sampling of the call's trajectory (header, else body field), else the endpoint's."""
        trajectory = header or (body.get(TRAJECTORY_FIELD) if isinstance(body, dict) else None)
        own = recorder.sampling(trajectory) if recorder is not None and isinstance(trajectory, str) else None
        return own or defaults

    async def complete(request: Request, parse) -> JSONResponse | StreamingResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON", "invalid_request_error")
        header = request.headers.get(TRAJECTORY_HEADER)
        try:
            req: CompletionRequest = parse(body, tokenizer, sampling_of(body, header), header)
        except OpenAIRequestError as e:
            return JSONResponse(e.body(), status_code=400)
        sampling = req.sampling
        if req.trajectory_id is not None:
            if recorder is None:
                return error(400, "this endpoint records no trajectories", "invalid_request_error", code="unknown_trajectory")
            try:
                cap = recorder.begin_call(req.trajectory_id, len(req.prompt_ids), sampling.max_new_tokens)
            except UnknownTrajectoryError:
                return error(400, f"trajectory {req.trajectory_id!r} is not open (the episode ended or never began)",
                             "invalid_request_error", code="unknown_trajectory")
            except EpisodeLimitError as e:
                return error(400, str(e), "invalid_request_error", param=e.limit, code="episode_limit")
            sampling = replace(sampling, max_new_tokens=cap)
        try:
            sample = await generate(req.prompt_ids, sampling)
        except RolloutRequestError as e:
            return error(502, f"the rollout servers refused or failed the call: {e}", "server_error")
        if sample.finish_reason not in ("stop", "length"):
            return error(503, f"generation ended with {sample.finish_reason!r} (the rollout was aborted)", "server_error")
        if sample.logprobs is None:
            return error(502, "the rollout servers returned no log-probs", "server_error")
        if req.trajectory_id is not None:
            recorder.add(req.trajectory_id, CallRecord(list(req.prompt_ids), list(sample.token_ids),
                                                       list(sample.logprobs), sample.finish_reason))
        result = Completion(sample.token_ids, sample.logprobs, completion_text(tokenizer, sample.token_ids, sample.matched),
                            sample.finish_reason, len(req.prompt_ids))
        rid = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if not req.stream:
            return JSONResponse(response_body(req, result, rid, created, tokenizer))
        chunks = [f"data: {json.dumps(c)}\n\n" for c in stream_chunks(req, result, rid, created, tokenizer)]
        return StreamingResponse(iter(chunks + ["data: [DONE]\n\n"]), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, functools.partial(parse_chat_request, template_kwargs=chat_template_kwargs))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, parse_completion_request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "megarl"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


class OpenAIEndpoint:
    """`build_app` served by uvicorn on a thread of this process; `port=0` takes a free port."""

    def __init__(self, generate: GenerateFn, tokenizer, defaults: SamplingDefaults,
                 recorder: Optional[TrajectoryRecorder] = None, *, model_name: str = "policy",
                 host: str = "127.0.0.1", port: int = 0, chat_template_kwargs: Optional[Mapping[str, Any]] = None):
        app = build_app(generate, tokenizer, defaults, recorder, model_name, chat_template_kwargs)
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                     access_log=False, lifespan="off"))
        self._thread: Optional[threading.Thread] = None
        self.host = host
        self.port: Optional[int] = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the endpoint is not started")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client's `base_url` should be."""
        return self.url + "/v1"

    def start(self, timeout_s: float = 30.0) -> None:
        if self._thread is not None:
            raise RuntimeError("the endpoint is already started")
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve()), name="megarl-openai",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.host} within {timeout_s} s")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the OpenAI endpoint did not stop within {timeout_s} s")
        self._thread = None
        self.port = None
