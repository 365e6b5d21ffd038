"""megarl's CPU engine behind SGLang's native HTTP API (FastAPI + uvicorn).

    python -m megarl.rollout.cpu.server --model-path DIR --port 30000 [--api-key KEY]

Serves the subset of SGLang 0.5.23's endpoints megarl drives, with SGLang's paths, field names,
status codes and state rules: `/generate`, `/health`, `/health_generate`, `/model_info`,
`/server_info` (and their deprecated `/get_*` names), `/flush_cache`, `/abort_request`,
`/init_weights_update_group`, `/destroy_weights_update_group`, `/begin_weight_update`,
`/end_weight_update`, `/update_weights_from_distributed`, `/update_weights_from_tensor`,
`/update_weights_from_disk`, `/release_memory_occupation`, `/resume_memory_occupation`,
`/weights_checker` (the "checksum" action: `rollout.weights_checker`), `/load_lora_adapter`,
`/load_lora_adapter_from_tensors`, `/unload_lora_adapter`, `/update_weight_version`
(`rollout.cpu.lora_adapters`). Tensor and
distributed updates are refused outside a `/begin_weight_update` ... `/end_weight_update` session,
as SGLang 0.5.23 refuses them. Bad requests get HTTP 400 with
`{"error": {"message": ...}}`, bodies that miss a field or have one of the wrong type HTTP 400 with
SGLang's `{"object": "error", "message", "type", "param", "code"}`; admin calls answer
`{"success", "message"}`. It binds to 127.0.0.1
unless told otherwise. With `--api-key`, every endpoint but `/health*` needs `Authorization: Bearer KEY`.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

import megarl
from megarl.rollout.cpu.engine import BATCH_WAIT_S, CPUEngine, SchedulerCrash, Sequence
from megarl.rollout.cpu.lora_adapters import LoraAdapters, add_lora_routes
from megarl.rollout.launch import EP_FLAG, NO_PREFIX_CACHE_FLAG
from megarl.rollout import tensor_payload, weights_checker
from megarl.rollout.protocol import BadRequestError, parse_generate_body
from megarl.rollout.routed_experts import SERVER_FLAG, encode_routed_experts
from megarl.rollout.weight_group import (
    destroy_process_group,
    init_custom_process_group,
    receive_bucket,
)

log = logging.getLogger("megarl.rollout.cpu.server")

OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")


class InitWeightsUpdateGroupReq(BaseModel):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReq(BaseModel):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedReq(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None


class UpdateWeightsFromTensorReq(BaseModel):
    """SGLang 0.5.23 `UpdateWeightsFromTensorReqInput` (managers/io_struct.py), HTTP form."""

    serialized_named_tensors: list[str]  # base64, one per TP rank (rank r reads entry r)
    load_format: Optional[str] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    selector: str = "all"
    torch_empty_cache: bool = False


class UpdateWeightsFromDiskReq(BaseModel):
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True


class BeginWeightUpdateReq(BaseModel):
    selector: str = "all"


class MemoryOccupationReq(BaseModel):
    """SGLang 0.5.23 `ReleaseMemoryOccupationReqInput` / `ResumeMemoryOccupationReqInput`: a body is
    required; tags None or []: all."""

    tags: Optional[list[str]] = None


class AbortReq(BaseModel):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReq(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"  # SGLang 0.5.23 `PauseGenerationReqInput`


class ContinueGenerationReq(BaseModel):
    torch_empty_cache: bool = True  # SGLang 0.5.23 `ContinueGenerationReqInput` (nothing to free on CPU)


def add_pause_routes(app: FastAPI, engine: CPUEngine) -> None:
    """SGLang 0.5.23's `/pause_generation` and `/continue_generation` (`entrypoints/http_server.py`):
    same request fields and replies (partial rollouts: abort, update the weights, continue)."""

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationReq):
        engine.pause_generation(req.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(req: Optional[ContinueGenerationReq] = None):
        engine.continue_generation()
        return {"message": "Generation continued successfully.", "status": "ok"}


class ApiKeyMiddleware:
    """SGLang's `--api-key` rule: `Authorization: Bearer KEY` on every path but /health*, /ready, /metrics.
    A plain ASGI middleware, so that handlers still see client disconnects."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        guarded = scope["type"] == "http" and scope["method"] != "OPTIONS"
        if guarded and not scope["path"].startswith(OPEN_PATH_PREFIXES):
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token, self.api_key):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class WeightSyncState:
    """The server's side of SGLang's weight-update protocol: open groups and the update session."""

    groups: dict[str, Any] = field(default_factory=dict)
    session_open: bool = False


def _result(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


def input_entry_id(token_id: int, vocab_size: int) -> int:
    """The token id an `input_token_logprobs` entry names: SGLang 0.5.23 reports the ids from
    vocab_size - 1 up as 0 (`managers/scheduler_components/logprob_result_processor.py::
    _process_input_token_logprobs`, "Clip padded hash values from image tokens"; the log-prob is
    still that of the real token). Output entries are not clipped."""
    return token_id if token_id < vocab_size - 1 else 0


def _output(engine: CPUEngine, seq: Sequence, n: int) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": seq.rid if n == 1 else f"{seq.rid}-{seq.index}",
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "finish_reason": seq.finish_reason,
        "weight_version": engine.weight_version,
        "e2e_latency": (seq.finished_s or time.monotonic()) - seq.created_s,
    }
    if seq.return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids)]
        # SGLang's `model_config.vocab_size`, the checkpoint's; read only for input entries (reading
        # a transformers config attribute takes microseconds, and this runs for every sample)
        vocab_size = engine.config.vocab_size if seq.input_logprobs else None
        meta["input_token_logprobs"] = [[lp, input_entry_id(tok, vocab_size), None] for lp, tok in
                                        zip(seq.input_logprobs, seq.prompt_ids[seq.logprob_start_len:])]
    if seq.return_logprob and seq.top_logprobs_num > 0:  # ids unclipped, as SGLang sends them
        meta["input_top_logprobs"] = [None if row is None else [[lp, tok, None] for lp, tok in row]
                                      for row in seq.input_top_logprobs]
        meta["output_top_logprobs"] = [[[lp, tok, None] for lp, tok in row] for row in seq.output_top_logprobs]
    if seq.routed_experts_start_len is not None and seq.routes:
        meta["routed_experts"] = encode_routed_experts(seq.routed_experts())
    return {"text": seq.text, "output_ids": seq.output_ids, "meta_info": meta}


class LoopHandoff:
    """Calls made on the engine's thread (or any other) run on the server's event loop, coalesced:
    one wake-up of the loop runs every call made since the last, in order. A batch's samples
    finish together, so their answers reach the loop in a few wake-ups rather than one per sample
    (each `call_soon_threadsafe` writes to the loop's wake-up pipe and hands it the GIL)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[..., None], tuple]] = []

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            self._pending.append((fn, args))
            wake = len(self._pending) == 1  # else a wake-up is already on its way
        if wake:
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, args in pending:
            fn(*args)


class RequestSamples:
    """The samples of one `/generate` request, prompt-major (prompt i's sample j at
    `offsets[i] + j`), collected on the event loop; `done` resolves once every one finished."""

    def __init__(self, loop: asyncio.AbstractEventLoop, counts: list[int]):
        self.offsets = list(itertools.accumulate(counts, initial=0))[:-1]
        self.samples: list[Optional[Sequence]] = [None] * sum(counts)
        self.left = len(self.samples)
        self.done = loop.create_future()

    def add(self, offset: int, seq: Sequence) -> None:
        """On the loop: sample `seq` of the prompt whose first sample is at `offset` finished."""
        self.samples[offset + seq.index] = seq
        self.left -= 1
        if self.left == 0 and not self.done.done():  # cancelled when the client went away
            self.done.set_result(self.samples)


async def _wait_unless_disconnected(request: Request, future: asyncio.Future, poll_s: float = 0.5) -> Optional[Any]:
    """The future's result, or None if the client disconnected first (or the handler was cancelled)."""
    try:
        while True:
            done, _ = await asyncio.wait({future}, timeout=poll_s)
            if done:
                return future.result()
            if await request.is_disconnected():
                future.cancel()
                return None
    except asyncio.CancelledError:
        future.cancel()
        return None


async def _json_body(request: Request, required: bool = True) -> Any:
    raw = await request.body()
    if not raw:
        if required:
            raise BadRequestError("the request body must be JSON")
        return {}
    try:
        return await request.json()
    except ValueError as e:
        raise BadRequestError(f"the request body is not valid JSON: {e}") from None


def _or_crash(call, what: str) -> None:
    """Run `call`; on `SchedulerCrash` end this server process at once, as SGLang's scheduler
    exception ends its server (the request gets no answer: its connection closes)."""
    try:
        call()
    except SchedulerCrash as crash:
        log.critical("%s: scheduler exception, the server exits (as SGLang's does): %s", what, crash)
        logging.shutdown()
        os._exit(1)


def build_app(engine: CPUEngine, api_key: Optional[str] = None) -> FastAPI:
    """The FastAPI application serving `engine` with SGLang's endpoints."""
    app = FastAPI(title="megarl CPU engine")
    sync = WeightSyncState()
    flush_turn = asyncio.Lock()  # FIFO: flushes are answered one at a time, in arrival order
    handoff: Optional[LoopHandoff] = None  # onto the serving loop, made by the first request

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(BadRequestError)
    async def bad_request(request: Request, exc: BadRequestError):
        return JSONResponse({"error": {"message": str(exc)}}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        """HTTP 400 (FastAPI's default is 422) with SGLang 0.5.23's body and message
        (`entrypoints/http_server.py::validation_exception_handler`)."""
        exc_str, errors_str = str(exc), str(exc.errors())
        message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
        return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None,
                             "code": 400}, status_code=400)

    @app.get("/health")
    @app.get("/health_generate")
    @app.get("/ready")
    async def health():
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.model_path,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "load_format": "auto",
            "model_type": getattr(engine.config, "model_type", None),
            "architectures": getattr(engine.config, "architectures", None),
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {
            "model_path": engine.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": engine.context_length,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": "fp8" if engine.fp8 is not None else None,  # SGLang's server argument
            "max_running_requests": engine.max_running_requests,
            "version": f"megarl-cpu-engine {megarl.__version__}",
            "internal_states": [
                {
                    "num_finished_requests": engine.num_finished,
                    "num_waiting_requests": engine.num_waiting,
                    "num_running_requests": engine.num_running,
                    "last_gen_throughput": engine.last_gen_throughput,
                    "released_memory": sorted(engine.released),
                }
            ],
        }

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        nonlocal handoff
        body = parse_generate_body(await _json_body(request))
        engine.check_can_generate()
        prompt_ids = [engine.tokenize(p.prompt) if isinstance(p.prompt, str) else p.prompt for p in body.prompts]
        for i, (ids, prompt) in enumerate(zip(prompt_ids, body.prompts)):
            try:
                engine.check_prompt(ids, prompt.sampling)
                if prompt.return_logprob:
                    engine.check_top_logprobs(prompt.top_logprobs_num, prompt.sampling)
            except BadRequestError as e:
                raise BadRequestError(f"prompt {i}: {e}" if len(body.prompts) > 1 else str(e)) from None
            engine.lora.resolve(prompt.lora_path, engine.model)  # an unknown adapter refuses the whole request
        loop = asyncio.get_running_loop()
        if handoff is None or handoff.loop is not loop:
            handoff = LoopHandoff(loop)
        collected = RequestSamples(loop, [prompt.sampling.n for prompt in body.prompts])
        rids = []
        with engine.submitting():  # a batch's prompts start together
            for ids, prompt, offset in zip(prompt_ids, body.prompts, collected.offsets):

                def on_done(seq: Sequence, offset=offset, handoff=handoff) -> None:
                    handoff.call(collected.add, offset, seq)

                rids.append(prompt.rid or uuid.uuid4().hex)
                routes = prompt.return_routed_experts and engine.return_routed_experts
                start = prompt.routed_experts_start_len if routes else None
                engine.submit(ids, prompt.sampling, prompt.return_logprob, rids[-1], on_done, prompt.lora_path,
                              routed_experts_start_len=start, logprob_start_len=prompt.logprob_start_len,
                              top_logprobs_num=prompt.top_logprobs_num)
        seqs = await _wait_unless_disconnected(request, collected.done)
        if seqs is None:  # the client went away: stop its work, as SGLang does
            for rid in rids:
                engine.abort(rid=rid)
            return Response(status_code=499)
        errors = [s.error for s in seqs if s.error]
        if errors:
            return JSONResponse({"error": {"message": errors[0]}}, status_code=500)
        outputs = [_output(engine, s, s.sampling.n) for s in seqs]
        # JSON types already: a JSONResponse skips FastAPI's jsonable_encoder walk over every
        # token's [logprob, id, None] (5x json.dumps's time for 128 samples of 128 tokens), same bytes
        return JSONResponse(outputs if body.batched else outputs[0])

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)):
        """SGLang 0.5.23's `/flush_cache`: at once when idle; with `timeout` (seconds) once the
        engine is idle within it (`managers/scheduler_components/flush_wrapper.py::
        SchedulerFlushWrapper`), else HTTP 400. One flush at a time, the others wait their turn in
        arrival order (its tokenizer manager's `FanOutCommunicator` in "queueing" mode,
        `managers/communicator.py`)."""
        async with flush_turn:
            if timeout > 0 and not engine.is_idle() and not await asyncio.to_thread(engine.wait_idle, timeout):
                return PlainTextResponse("Timed out waiting for idle state.", status_code=400)
            if not engine.is_idle():
                return PlainTextResponse("Flush cache failed: requests are running or waiting.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                                 "or waiting requests, the operation will not be performed.)\n")

    @app.post("/abort_request")
    async def abort_request(req: AbortReq):
        engine.abort(rid=req.rid, abort_all=req.abort_all)
        return Response(status_code=200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(req: MemoryOccupationReq):
        _or_crash(lambda: engine.release_memory(req.tags), "release_memory_occupation")  # answers null, as SGLang

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(req: MemoryOccupationReq):
        _or_crash(lambda: engine.resume_memory(req.tags), "resume_memory_occupation")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(req: InitWeightsUpdateGroupReq):
        if req.group_name in sync.groups:
            return _result(False, f"Group {req.group_name!r} already exists; destroy it first.")
        try:
            group = await asyncio.to_thread(
                init_custom_process_group,
                req.backend, req.master_address, req.master_port, req.rank_offset, req.world_size, req.group_name,
            )
        except Exception as e:  # any rendezvous or backend failure is the caller's to see
            return _result(False, f"Failed to initialize custom process group: {e}.")
        sync.groups[req.group_name] = group
        return _result(True, "Succeeded to initialize custom process group.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(req: DestroyWeightsUpdateGroupReq):
        group = sync.groups.pop(req.group_name, None)
        if group is None:
            return _result(False, "The group to be destroyed does not exist.")
        destroy_process_group(group)
        return _result(True, "Succeeded to destroy custom process group.")

    @app.post("/begin_weight_update")
    async def begin_weight_update(req: BeginWeightUpdateReq):
        if sync.session_open:
            return _result(False, "a weight-update session is already open; call end_weight_update() first")
        sync.session_open = True
        return _result(True, "Success")

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        if not sync.session_open:
            return _result(False, "no weight-update session is open; call begin_weight_update() first")
        sync.session_open = False
        return _result(True, "Success")

    def after_update(weight_version: Optional[str], flush: bool, message: str, **extra: Any) -> JSONResponse:
        """SGLang 0.5.23's end of an update: the new version (named in the message, as
        `managers/tokenizer_control_mixin.py` adds it), then the cache flush, refused while requests run."""
        if weight_version is not None:
            engine.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
        if flush and not engine.is_idle():
            return _result(
                False,
                "Weights were updated, but the cache was not flushed because requests are still running or "
                "queued. Retract or finish them, then call /flush_cache.",
                **extra,
            )
        return _result(True, message, **extra)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(req: UpdateWeightsFromDistributedReq):
        if not sync.session_open:
            return _result(
                False, "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        group = sync.groups.get(req.group_name)
        if group is None:
            known = list(sync.groups)
            return _result(False, f"Failed to receive weights: Group {req.group_name} not in {known}. "
                                  "Please call `init_weights_update_group` first.")
        if req.abort_all_requests:
            engine.abort(abort_all=True)

        def receive_and_load() -> Optional[str]:
            """In one worker thread (one hand-over less than a thread for each): the receive, then the
            load; the failure's message as SGLang 0.5.23 words it (`scheduler_components/weight_updater.py::
            update_weights_from_distributed`), or None."""
            try:
                tensors = receive_bucket(group, req.names, req.dtypes, req.shapes, req.load_format)
            except (ValueError, RuntimeError) as e:
                return f"Failed to receive weights: {e}"
            try:
                engine.load_weights(tensors)
            except BadRequestError as e:
                return f"Failed to update parameter online: {e}"
            return None

        failure = await asyncio.to_thread(receive_and_load)
        if failure is not None:
            return _result(False, failure)
        return after_update(req.weight_version, req.flush_cache, "Succeeded to update parameter online.")

    def load_tensor_payload(entry: str, load_format: Optional[str]) -> int:
        """Deserialise this rank's entry and load it; the shared tensors are dropped on return."""
        try:
            tensor_payload.check_load_format(load_format)
            tensors = tensor_payload.named_tensors(tensor_payload.deserialize(entry), load_format)
        except ValueError as e:
            raise BadRequestError(str(e)) from None
        return engine.load_weights(tensors)

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(req: UpdateWeightsFromTensorReq):
        if not sync.session_open:
            return _result(
                False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            )
        tp_size = 1
        if len(req.serialized_named_tensors) != tp_size:
            return _result(False, f"serialized_named_tensors has {len(req.serialized_named_tensors)} entries; this "
                                  f"server has TP size {tp_size} and needs one per TP rank")
        if req.abort_all_requests:
            engine.abort(abort_all=True)
        try:
            await asyncio.to_thread(load_tensor_payload, req.serialized_named_tensors[0], req.load_format)
        except BadRequestError as e:
            return _result(False, f"Failed to update parameter online: {e}")
        return after_update(req.weight_version, req.flush_cache, "Success")  # SGLang's words for a tensor push

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsFromDiskReq):
        if req.abort_all_requests:
            engine.abort(abort_all=True)
        try:
            await asyncio.to_thread(engine.load_weights_from_disk, req.model_path)
        except BadRequestError as e:
            return _result(False, str(e), num_paused_requests=0)
        return after_update(
            req.weight_version, req.flush_cache, "Succeeded to update model weights.", num_paused_requests=0
        )

    add_pause_routes(app, engine)
    add_lora_routes(app, engine)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def check_weights(request: Request):
        req = weights_checker.CheckWeightsReq(**(await _json_body(request, required=False)))
        if req.action != "checksum":
            return _result(False, f"Unsupported action={req.action!r}: the CPU engine answers 'checksum' only")

        def checksums() -> dict:
            engine._check_weights_resident()
            with engine.exclusive_model() as model:
                return weights_checker.checksum_response(engine.checked_tensors(model), req.skip_tensor_list)

        try:
            return await asyncio.to_thread(checksums)
        except BadRequestError as e:
            return _result(False, str(e))

    return app


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (not on /health)")
    p.add_argument("--dtype", default="auto", help="auto (= float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--context-length", type=int, default=None, help="default: config.max_position_embeddings")
    p.add_argument("--max-running-requests", type=int, default=64, help="sequences decoded together")
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--batch-wait-ms", type=float, default=BATCH_WAIT_S * 1000,
                   help="a batch starts once no request arrived for this long (a burst becomes one batch)")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag)")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=[], help="PEFT names, or all")
    p.add_argument("--log-level", default="warning")
    p.add_argument(SERVER_FLAG, action="store_true", help="record routed experts (MoE; SGLang's flag)")
    p.add_argument(NO_PREFIX_CACHE_FLAG, action="store_true",
                   help="prefill every sample on its own, sharing no prompt's keys and values (SGLang's flag)")
    p.add_argument(EP_FLAG, "--expert-parallel-size", type=int, default=1, dest="ep_size",
                   help="SGLang's expert parallel size: 1 only (one process serves the whole model)")
    args = p.parse_args(argv)
    if args.ep_size != 1:
        p.error(f"{EP_FLAG} {args.ep_size}: megarl's CPU engine serves a whole model in one process and splits no "
                "experts, so it takes 1 only")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = CPUEngine(
        args.model_path,
        dtype=args.dtype,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        random_seed=args.random_seed,
        weight_version=args.weight_version,
        batch_wait_s=args.batch_wait_ms / 1000,
        lora=LoraAdapters(args.enable_lora, args.max_lora_rank, args.lora_target_modules),
        return_routed_experts=args.enable_return_routed_experts,
        prefix_sharing=not args.disable_radix_cache,
    )
    # uvloop's event loop and httptools' parser, as uvicorn's `standard` install picks them; named
    # here so that a missing one fails the start, not the speed
    uvicorn.run(build_app(engine, args.api_key), host=args.host, port=args.port, log_level=args.log_level,
                loop="uvloop", http="httptools")


if __name__ == "__main__":
    main()
