"""LoRA adapter serving for megarl's CPU engine, as SGLang 0.5.23 serves them.

SGLang's model (read from its wheel): a server started with `--enable-lora --max-lora-rank R
--lora-target-modules ...` loads PEFT adapters by name from a directory (`/load_lora_adapter`,
`LoadLoRAAdapterReqInput`: lora_name, lora_path, pinned), drops them by name
(`/unload_lora_adapter`, `UnloadLoRAAdapterReqInput`: lora_name), and a `/generate` request picks
one with its `lora_path` field (an adapter *name*; per prompt, or one for all); requests without
it use the base model. Replies of load/unload are `LoRAUpdateOutput` {success, error_message,
loaded_adapters {name: path}}, HTTP 200 or 400. The messages below are SGLang's
(`managers/tokenizer_manager.py`, `tokenizer_control_mixin.py`, `lora/lora_registry.py`,
`lora/lora_manager.py`). SGLang remembers every name it loaded: a request naming an adapter that
was unloaded reloads it from its path; a name never loaded is refused. Requests already queued
keep the adapter they resolved (SGLang's unload waits for them to finish).
`/load_lora_adapter_from_tensors` (`LoadLoRAAdapterFromTensorsReqInput`, managers/io_struct.py
~2548; http_server.py ~1663) loads the same adapter from the request itself: `config_dict` is
adapter_config.json, `serialized_named_tensors` one base64 pickle per TP rank (rank r reads entry
r, managers/tp_worker.py `deserialize_own_rank`) of {PEFT tensor name: tensor}, the names and
tensors of adapter_model.safetensors (tp_worker.py `load_lora_adapter_from_tensors`,
lora/lora.py `initialize_weights_from_tensors`). Such an adapter is registered with the path
"__tensor__" (its `to_ref`), so a request naming it after its unload fails to reload it.
Both endpoints build the adapter with one function (`peft_adapter`): the same adapter, the same
log-probs.

Here an adapter adds s B (A x) to the output of each targeted HF linear layer (s = alpha / r,
alpha / sqrt(r) with rsLoRA), through forward hooks held while a batch that names it runs: the
base weights are never changed, so they stay exact and weight updates apply under the adapter.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import json
import pickle
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence as Seq

import torch
import torch.nn.functional as F
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from megarl.rollout import tensor_payload
from megarl.rollout.protocol import BadRequestError

ALL_TARGETS = "all"  # SGLang's LORA_TARGET_ALL_MODULES
TENSOR_PATH = "__tensor__"  # SGLang 0.5.23's lora_path of an adapter loaded from tensors (io_struct.py `to_ref`)
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoadedAdapter:
    """One PEFT adapter: {HF module name: (A [r, in], B [out, r])} and its scale."""

    name: str
    path: str
    rank: int
    scale: float
    targets: frozenset[str]  # PEFT target names: its modules' last name parts and its config's target_modules
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_peft_adapter(name: str, path: str, dtype: torch.dtype) -> LoadedAdapter:
    """Read `adapter_config.json` and `adapter_model.safetensors` of a PEFT LoRA directory."""
    from safetensors.torch import load_file

    directory = Path(path)
    try:
        config = json.loads((directory / "adapter_config.json").read_text())
        tensors = load_file(str(directory / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise BadRequestError(f"Failed to load LoRA adapter {name} from {path}: {e}") from e
    return peft_adapter(name, str(path), config, tensors, dtype)


def peft_adapter(name: str, path: str, config: Any, tensors: Any, dtype: torch.dtype) -> LoadedAdapter:
    """The adapter of a PEFT `adapter_config.json` (a dict) and its tensors {PEFT name: tensor}, read
    from a directory or sent in a request. SGLang 0.5.23 reads `r`, `lora_alpha`, `target_modules`
    and `use_dora` from the config (lora/lora_config.py) and refuses DoRA (lora_manager.py
    `validate_new_adapter`)."""
    if not isinstance(config, dict):
        raise BadRequestError(f"Failed to load LoRA adapter {name}: config_dict must be a JSON object")
    missing = [key for key in ("r", "lora_alpha", "target_modules") if key not in config]
    if missing:  # a KeyError in SGLang's LoRAConfig, answered as the load's error
        raise BadRequestError(f"Failed to load LoRA adapter {name}: adapter config lacks {missing}")
    if config.get("use_dora"):
        raise BadRequestError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    if not isinstance(tensors, dict):  # SGLang iterates `tensors.items()` (lora.py initialize_weights_from_tensors)
        raise BadRequestError(f"Failed to load LoRA adapter {name}: the tensors must be a dict {{PEFT name: tensor}}, "
                              f"got {type(tensors).__name__}")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key) if isinstance(key, str) else None
        if m is None or not isinstance(tensor, torch.Tensor):
            raise BadRequestError(f"Failed to load LoRA adapter {name}: unexpected tensor {key!r}")
        parts.setdefault(m.group(1), {})[m.group(2)] = tensor.to(dtype)
    incomplete = [module for module, p in parts.items() if set(p) != {"A", "B"}]
    if incomplete:
        raise BadRequestError(f"Failed to load LoRA adapter {name}: {incomplete[:3]} lack lora_A or lora_B")
    factors = {module: (p["A"], p["B"]) for module, p in parts.items()}
    targets = frozenset(m.rsplit(".", 1)[-1] for m in factors) | _config_targets(name, config["target_modules"])
    return LoadedAdapter(name, path, rank, scale, targets, factors)


def _fused(targets: frozenset[str]) -> frozenset[str]:
    """Target names as SGLang 0.5.23 compares them, its fused layers' (lora/utils.py
    `get_normalized_target_modules`): q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj."""
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}
    return frozenset(fused.get(t, t) for t in targets)


def _config_targets(name: str, target_modules: Any) -> frozenset[str]:
    """The targets the config names (last name parts); "all" / "all-linear" (SGLang's shorthands,
    lora/utils.py `get_normalized_target_modules`) names none beyond the tensors' own."""
    if isinstance(target_modules, str):
        if target_modules not in ("all", "all-linear"):
            raise BadRequestError(f"Failed to load LoRA adapter {name}: Only 'all' or 'all-linear' can be used as "
                                  "the string for target module")
        return frozenset()
    if not isinstance(target_modules, list) or not all(isinstance(t, str) for t in target_modules):
        raise BadRequestError(f"Failed to load LoRA adapter {name}: target_modules must be a list of names")
    return frozenset(t.rsplit(".", 1)[-1] for t in target_modules)


def adapter_tensors(req: LoadLoraAdapterFromTensorsReq) -> dict:
    """{PEFT name: tensor} of a `/load_lora_adapter_from_tensors` request, as SGLang 0.5.23 reads
    it: entry 0 (this TP rank's) of `serialized_named_tensors`, a base64 pickle of the dict, or
    with load_format "flattened_bucket" of a {flattened_tensor, metadata} bucket (tp_worker.py
    `load_lora_adapter_from_tensors`); `expected_checksums` {name: sha256 hex of the tensor's bytes}
    must name exactly the tensors sent. The pickle may hold tensors by value (SGLang's SafeUnpickler
    maps `torch.storage._load_from_bytes` to `torch.load(weights_only=True)`, utils/common.py) or in
    shared memory (same host only); it is unpickled with an allow-list, never plain `pickle.loads`."""
    if len(req.serialized_named_tensors) != 1:  # TP size 1
        raise BadRequestError(f"serialized_named_tensors has {len(req.serialized_named_tensors)} entries; this "
                              "server has TP size 1 and needs one per TP rank")
    entry = req.serialized_named_tensors[0]
    try:
        raw = base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequestError(f"a serialized_named_tensors entry is not valid base64: {e}") from None
    try:
        data = _AdapterUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # unpickling runs torch's rebuild functions: any failure is the payload's
        raise BadRequestError(f"a serialized_named_tensors entry could not be unpickled: {type(e).__name__}: {e}") \
            from None
    if req.load_format == "flattened_bucket":
        try:
            data = dict(tensor_payload.named_tensors(data, "flattened_bucket"))
        except ValueError as e:
            raise BadRequestError(str(e)) from None
    if req.expected_checksums is not None and isinstance(data, dict):
        want = req.expected_checksums
        got = {n: hashlib.sha256(t.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()
               for n, t in data.items() if isinstance(t, torch.Tensor)}
        mismatch = [n for n in want if n in got and got[n] != want[n]]
        missing = [n for n in want if n not in data]
        extra = [n for n in data if n not in want]
        if mismatch or missing or extra:
            raise BadRequestError(f"[LORA-CHECK] rank0 adapter sync MISMATCH of {len(want)} expected: "
                                  f"{len(mismatch)} value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, "
                                  f"{len(extra)} extra {extra[:5]}")
    return data


def _load_storage(data: bytes):
    """A storage pickled by value (`torch.storage._load_from_bytes`), loaded without running code."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


class _AdapterUnpickler(tensor_payload._RestrictedUnpickler):
    """The weight payloads' allow-list plus storages by value, as SGLang 0.5.23's SafeUnpickler."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        return super().find_class(module, name)


class LoraAdapters:
    """The adapters a CPU engine serves, by name (thread-safe)."""

    def __init__(self, enabled: bool = False, max_rank: Optional[int] = None, targets: Seq[str] = ()):
        self.enabled, self.max_rank, self.targets = enabled, max_rank, frozenset(targets)
        self.loaded: dict[str, LoadedAdapter] = {}
        self.known: dict[str, str] = {}  # every name ever loaded -> its path (SGLang's lora_ref_cache)
        self._lock = threading.Lock()

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise BadRequestError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")

    def load(self, name: str, path: str, model: torch.nn.Module) -> None:
        """`/load_lora_adapter`: SGLang's checks, then read the PEFT directory and check it fits `model`."""
        self._check_enabled()
        self._check_new(name)
        self._add(read_peft_adapter(name, path, next(model.parameters()).dtype), model)

    def load_from_tensors(self, req: LoadLoraAdapterFromTensorsReq, model: torch.nn.Module) -> None:
        """`/load_lora_adapter_from_tensors`: the same checks and adapter as `load`, from the request."""
        self._check_enabled()
        self._check_new(req.lora_name)
        if req.added_tokens_config and any(i >= model.config.vocab_size for i in req.added_tokens_config.values()):
            raise BadRequestError(f"Failed to load {req.lora_name} because LoRA serving currently doesn't support "
                                  "adapters that add tokens to the vocabulary")
        dtype = next(model.parameters()).dtype
        self._add(peft_adapter(req.lora_name, TENSOR_PATH, req.config_dict, adapter_tensors(req), dtype), model)

    def _check_new(self, name: str) -> None:
        with self._lock:
            if name in self.loaded:
                raise BadRequestError(f"Failed to load LoRA adapter {name} because it is already loaded")

    def _add(self, adapter: LoadedAdapter, model: torch.nn.Module) -> None:
        """SGLang's memory-pool check (rank, target modules), then the shapes against `model`."""
        name = adapter.name
        fits = (self.max_rank is None or adapter.rank <= self.max_rank) and (
            ALL_TARGETS in self.targets or _fused(adapter.targets) <= _fused(self.targets))
        if not fits:
            raise BadRequestError(
                f"LoRA adapter {name} with rank {adapter.rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        modules = dict(model.named_modules())
        for module, (a, b) in adapter.factors.items():
            base = modules.get(module)
            if not isinstance(base, torch.nn.Linear) or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] \
                    or a.shape[1] != base.in_features or b.shape[0] != base.out_features:
                raise BadRequestError(f"Failed to load LoRA adapter {name}: {module} with A {tuple(a.shape)}, B "
                                      f"{tuple(b.shape)} does not fit the served model")
        with self._lock:
            if name in self.loaded:  # loaded meanwhile by another call
                raise BadRequestError(f"Failed to load LoRA adapter {name} because it is already loaded")
            self.loaded[name] = adapter
            self.known[name] = adapter.path

    def unload(self, name: str) -> None:
        self._check_enabled()
        with self._lock:
            if name not in self.loaded:
                raise BadRequestError(f"LoRA with name {name} does not exist. Loaded LoRAs: {self.loaded.keys()}")
            del self.loaded[name]

    def resolve(self, name: Optional[str], model: torch.nn.Module) -> Optional[LoadedAdapter]:
        """The adapter a request names (None: the base model); an unloaded one is loaded again
        from its path, a name never loaded is refused."""
        if not name:
            return None
        if not self.enabled:
            raise BadRequestError(
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
        with self._lock:
            adapter, path = self.loaded.get(name), self.known.get(name)
        if adapter is not None:
            return adapter
        if path is None:
            raise BadRequestError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                  f"All loaded adapters: {self.known.keys()}.")
        try:
            self.load(name, path, model)
        except BadRequestError as e:
            if "already loaded" not in str(e):
                raise BadRequestError(f"Failed to implicitly load LoRA adapter {name}: {e}") from None
        with self._lock:
            return self.loaded[name]

    def reply(self, success: bool, error_message: str = "") -> JSONResponse:
        """SGLang's `LoRAUpdateOutput`."""
        with self._lock:
            loaded = {n: a.path for n, a in self.loaded.items()}
        return JSONResponse({"success": success, "error_message": error_message, "loaded_adapters": loaded},
                            status_code=200 if success else 400)


@contextmanager
def applied(model: torch.nn.Module, adapter: Optional[LoadedAdapter]) -> Iterator[None]:
    """Inside: each module `adapter` targets outputs W x + s B (A x) (PEFT's forward, unmerged)."""
    if adapter is None:
        yield
        return
    handles = []
    try:
        for module, (a, b) in adapter.factors.items():
            def hook(mod, args, output, a=a, b=b):
                return output + F.linear(F.linear(args[0].to(a.dtype), a), b).to(output.dtype) * adapter.scale

            handles.append(model.get_submodule(module).register_forward_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


class LoadLoraAdapterReq(BaseModel):
    lora_name: str  # SGLang 0.5.23 `LoadLoRAAdapterReqInput`
    lora_path: str
    pinned: bool = False
    lora_id: Optional[str] = None


class LoadLoraAdapterFromTensorsReq(BaseModel):
    """SGLang 0.5.23 `LoadLoRAAdapterFromTensorsReqInput` (managers/io_struct.py ~2548), HTTP form:
    its fields and defaults (BaseReq's `rid` and `http_worker_ipc` are ignored, as unknown keys are)."""

    lora_name: str
    config_dict: dict[str, Any]  # adapter_config.json
    serialized_named_tensors: list[str]  # base64, one per TP rank (rank r reads entry r)
    pinned: bool = False  # no memory pool on CPU: accepted, changes nothing
    added_tokens_config: Optional[dict[str, int]] = None
    lora_id: Optional[str] = None
    load_format: Optional[str] = None  # "flattened_bucket", or anything else: the pickled dict itself
    expected_checksums: Optional[dict[str, str]] = None  # {PEFT name: sha256 hex of the tensor's bytes}


class UnloadLoraAdapterReq(BaseModel):
    lora_name: str  # SGLang 0.5.23 `UnloadLoRAAdapterReqInput`
    lora_id: Optional[str] = None


class UpdateWeightVersionReq(BaseModel):
    new_version: str  # SGLang 0.5.23 `UpdateWeightVersionReqInput`
    abort_all_requests: bool = True


def add_lora_routes(app: FastAPI, engine: Any) -> None:
    """SGLang 0.5.23's `/load_lora_adapter`, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter`
    and `/update_weight_version`
    (an adapter push names the new policy's version with it)."""

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraAdapterReq):
        try:
            engine.lora.load(req.lora_name, req.lora_path, engine.model)
        except BadRequestError as e:
            return engine.lora.reply(False, str(e))
        return engine.lora.reply(True)

    @app.post("/load_lora_adapter_from_tensors")
    async def load_lora_adapter_from_tensors(req: LoadLoraAdapterFromTensorsReq):
        try:
            await asyncio.to_thread(engine.lora.load_from_tensors, req, engine.model)
        except BadRequestError as e:
            return engine.lora.reply(False, str(e))
        return engine.lora.reply(True)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraAdapterReq):
        try:
            engine.lora.unload(req.lora_name)
        except BadRequestError as e:
            return engine.lora.reply(False, str(e))
        return engine.lora.reply(True)

    @app.post("/update_weight_version")
    async def update_weight_version(req: UpdateWeightVersionReq):
        if req.abort_all_requests:
            engine.abort(abort_all=True)
        engine.weight_version = req.new_version
        return {"success": True, "message": f"Weight version updated to {req.new_version}",
                "new_version": req.new_version}
