"""Move a model's parameters, gradients and optimizer state out of device memory and back.

Works on tensor *storages*: a storage is copied to a host buffer (pinned on GPU) and then
resized to 0 bytes, which frees the device memory while every tensor that views it (parameters,
megatron's flat gradient buffers and their per-parameter views, optimizer moments) stays a valid
object; `onload` resizes the storage back and copies the bytes in. Gradient storages are freed
without copying and come back zeroed (they hold nothing between updates). On a CPU-only machine
the "device" is host memory too: the same copies and frees happen, between two host buffers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch


def unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` that live on `device`'s type."""
    seen, out = set(), []
    for t in tensors:
        if t is None or t.device.type != device.type:
            continue
        storage = t.untyped_storage()
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
