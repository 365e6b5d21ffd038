"""Move a model's parameters, gradients and optimizer state out of device memory and back.

Works on tensor *storages*: a storage is copied to a host buffer (pinned on GPU) and then
resized to 0 bytes, which frees the device memory while every tensor that views it (parameters,
megatron's flat gradient buffers and their per-parameter views, optimizer moments) stays a valid
object; `onload` resizes the storage back and copies the bytes in. Gradient storages are freed
without copying and come back zeroed (they hold nothing between updates). On a CPU-only machine
the "device" is host memory too: the same copies and frees happen, between two host buffers.

`Offloader` does this for one engine: its model chunks, megatron's DDP buffers and the optimizer
state, and it remembers which parts are offloaded. With FSDP2 (engines.megatron.fsdp2) the
parameters, their gradients and the AdamW moments are DTensors: what moves is each one's local
shard (the storage of a parameter's or gradient's is FSDP2's padded shard, `ceil(rows / (DP x CP))`
rows on every rank), and the engine reshards first (`MegatronEngine.offload`), so that no
all-gathered parameter is left on the device. Parts may leave in steps (colocated, the gradients
and optimizer state before the weight push, the parameters after it:
`megarl.placement.colocated_memory`) and all come back together.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters, gradients, AdamW moments: a DTensor's own
    `untyped_storage()` is no valid storage), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` (a DTensor's: its local shard's) that live on
    `device`'s type."""
    seen, out = set(), []
    for t in tensors:
        if t is None or t.device.type != device.type:
            continue
        storage = local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(storage)
    return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class OffloadedStorages:
    """Storages moved off the device: those kept (copied to host) and those dropped (zeroed on return)."""

    kept: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] = field(default_factory=list)
    dropped: list[tuple[torch.UntypedStorage, int]] = field(default_factory=list)


def offload(
    keep: list[torch.UntypedStorage], drop: list[torch.UntypedStorage], device: torch.device
) -> tuple[OffloadedStorages, dict]:
    """Copy `keep` to host memory and free it; free `drop`. Returns the record for `onload` and
    {"bytes": bytes copied to host, "freed_bytes": device bytes released, "seconds": wall time}."""
    start = time.perf_counter()
    _synchronize(device)
    record = OffloadedStorages()
    pin = device.type == "cuda"
    copied = freed = 0
    for storage in keep:
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
        host.copy_(storage)
        record.kept.append((storage, host))
        copied += storage.nbytes()
    for storage in drop:
        record.dropped.append((storage, storage.nbytes()))
    for storage in keep + drop:
        freed += storage.nbytes()
        storage.resize_(0)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _synchronize(device)
    return record, {"bytes": copied, "freed_bytes": freed, "seconds": time.perf_counter() - start}


def onload(record: OffloadedStorages, device: torch.device) -> dict:
    """Undo `offload`: reallocate every storage, copy kept bytes back, zero dropped ones.
    Returns {"bytes": bytes copied to the device, "seconds": wall time}."""
    start = time.perf_counter()
    copied = 0
    for storage, host in record.kept:
        storage.resize_(host.nbytes())
        storage.copy_(host)
        copied += host.nbytes()
    for storage, nbytes in record.dropped:
        storage.resize_(nbytes)
        storage.fill_(0)
    _synchronize(device)
    return {"bytes": copied, "seconds": time.perf_counter() - start}


class Offloader:
    """Offload and onload of one engine's parameters (model chunks and DDP parameter buffers),
    gradients (DDP buffers, or the parameters' own `.grad`: FSDP2's) and optimizer state, on
    `device`. The optimizer state is looked up at each `offload` (the optimizer creates it at its
    first step).

    Each storage belongs to exactly one part, the first of parameters, optimizer, gradients that
    uses it (`storages()`), and moves only with that part. So a storage two parts share moves
    once and stays consistent: the fp32 model's parameters are also the optimizer's (they move
    with `params`); megatron's MXFP8 buffer is both a parameter and a gradient buffer (it moves,
    copied, with `params`); and a storage of values is never dropped as a gradient."""

    PARTS = ("params", "grads", "optimizer")

    def __init__(self, section: str, model_chunks: list, ddp_chunks: Optional[list], optimizer, device: torch.device):
        self.section = section
        self.model_chunks, self.ddp_chunks, self.optimizer = model_chunks, ddp_chunks or [], optimizer
        self.device = device
        self._offloaded: list[OffloadedStorages] = []  # one record per `offload` that moved something
        self.parts_offloaded: set[str] = set()

    def storages(self) -> tuple[list, list, list]:
        """(parameter, gradient, optimizer-state) storages on the device, each storage in one
        list only: parameters first, then optimizer state, then gradient buffers."""
        params = [p for chunk in self.model_chunks for p in chunk.parameters()]
        grads = [p.grad for p in params if p.grad is not None]  # FSDP2's shards; DDP's views of its buffers
        for chunk in self.ddp_chunks:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                params.append(buffer.param_data)
                grads.append(buffer.grad_data)
        state = []
        if self.optimizer is not None:
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                torch_opt = opt.optimizer
                for group in torch_opt.param_groups:
                    for p in group["params"]:
                        state.append(p)
                        state.extend(v for v in torch_opt.state.get(p, {}).values() if torch.is_tensor(v))
        param_storages = unique_storages(params, self.device)
        taken = {s.data_ptr() for s in param_storages}
        state_storages = [s for s in unique_storages(state, self.device) if s.data_ptr() not in taken]
        taken |= {s.data_ptr() for s in state_storages}
        grad_storages = [s for s in unique_storages(grads, self.device) if s.data_ptr() not in taken]
        return param_storages, grad_storages, state_storages

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict:
        """Move the chosen parts off the device, those not off already: parameters and optimizer
        state are copied to host memory, gradient buffers freed (they come back zeroed). Returns
        {"bytes": copied to host, "freed_bytes": device bytes released, "seconds", and
        "params_bytes", "grads_bytes", "optimizer_bytes": device bytes released per part}; zeros
        when there is nothing left to move. The engine refuses to compute while any part is off
        (`check_onloaded`), and to push its weights while its parameters are."""
        chosen = {p for p, on in zip(self.PARTS, (params, grads, optimizer)) if on} - self.parts_offloaded
        zero = {"bytes": 0, "freed_bytes": 0, "seconds": 0.0, **{f"{p}_bytes": 0 for p in self.PARTS}}
        if not chosen:
            return zero
        # a storage already moved has 0 bytes: `storages()` leaves it out, so each moves once
        param_storages, grad_storages, state_storages = self.storages()
        param_storages = param_storages if "params" in chosen else []
        grad_storages = grad_storages if "grads" in chosen else []
        state_storages = state_storages if "optimizer" in chosen else []
        per_part = {f"{name}_bytes": sum(s.nbytes() for s in storages) for name, storages in
                    (("params", param_storages), ("grads", grad_storages), ("optimizer", state_storages))}
        record, stats = offload(param_storages + state_storages, grad_storages, self.device)
        self._offloaded.append(record)
        self.parts_offloaded |= chosen
        return {**stats, **per_part}

    def onload(self) -> dict:
        """Bring back everything `offload` moved. Returns {"bytes": copied to the device, "seconds"}."""
        stats = {"bytes": 0, "seconds": 0.0}
        for record in reversed(self._offloaded):
            moved = onload(record, self.device)
            stats = {"bytes": stats["bytes"] + moved["bytes"], "seconds": stats["seconds"] + moved["seconds"]}
        self._offloaded, self.parts_offloaded = [], set()
        return stats

    def check_onloaded(self, parts: tuple[str, ...] = PARTS) -> None:
        """Raise if any of `parts` is off the device."""
        off = [p for p in parts if p in self.parts_offloaded]
        if off:
            raise RuntimeError(f"{self.section}: the engine's {', '.join(off)} are offloaded; call onload() first")
