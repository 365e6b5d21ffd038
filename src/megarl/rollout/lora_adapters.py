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
SGLang 0.5.23 also has `/load_lora_adapter_from_tensors` (serialized tensors per TP rank);
megarl uses the path-based endpoint.

Here an adapter adds s B (A x) to the output of each targeted HF linear layer (s = alpha / r,
alpha / sqrt(r) with rsLoRA), through forward hooks held while a batch that names it runs: the
base weights are never changed, so they stay exact and weight updates apply under the adapter.
"""
from __future__ import annotations

import json
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

from megarl.rollout.protocol import BadRequestError

ALL_TARGETS = "all"  # SGLang's LORA_TARGET_ALL_MODULES
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class LoadedAdapter:
    """One PEFT adapter: {HF module name: (A [r, in], B [out, r])} and its scale."""

    name: str
    path: str
    rank: int
    scale: float
    targets: frozenset[str]  # PEFT target names (the modules' last name part)
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
    if config.get("use_dora"):
        raise BadRequestError(f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise BadRequestError(f"Failed to load LoRA adapter {name}: unexpected tensor {key!r}")
        parts.setdefault(m.group(1), {})[m.group(2)] = tensor.to(dtype)
    incomplete = [module for module, p in parts.items() if set(p) != {"A", "B"}]
    if incomplete:
        raise BadRequestError(f"Failed to load LoRA adapter {name}: {incomplete[:3]} lack lora_A or lora_B")
    factors = {module: (p["A"], p["B"]) for module, p in parts.items()}
    return LoadedAdapter(name, str(path), rank, scale, frozenset(m.rsplit(".", 1)[-1] for m in factors), factors)


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
        """SGLang's checks, then read the adapter and check it fits `model`."""
        self._check_enabled()
        with self._lock:
            if name in self.loaded:
                raise BadRequestError(f"Failed to load LoRA adapter {name} because it is already loaded")
        adapter = read_peft_adapter(name, path, next(model.parameters()).dtype)
        fits = (self.max_rank is None or adapter.rank <= self.max_rank) and (
            ALL_TARGETS in self.targets or adapter.targets <= self.targets)
        if not fits:
            raise BadRequestError(
                f"LoRA adapter {name} with rank {adapter.rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        modules = dict(model.named_modules())
        for module, (a, b) in adapter.factors.items():
            base = modules.get(module)
            if not isinstance(base, torch.nn.Linear) or a.shape[1] != base.in_features or b.shape[0] != base.out_features:
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


class UnloadLoraAdapterReq(BaseModel):
    lora_name: str  # SGLang 0.5.23 `UnloadLoRAAdapterReqInput`
    lora_id: Optional[str] = None


class UpdateWeightVersionReq(BaseModel):
    new_version: str  # SGLang 0.5.23 `UpdateWeightVersionReqInput`
    abort_all_requests: bool = True


def add_lora_routes(app: FastAPI, engine: Any) -> None:
    """SGLang 0.5.23's `/load_lora_adapter`, `/unload_lora_adapter` and `/update_weight_version`
    (an adapter push names the new policy's version with it)."""

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraAdapterReq):
        try:
            engine.lora.load(req.lora_name, req.lora_path, engine.model)
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
