"""The weight-update process group between a trainer and rollout servers, and its bucket layout.

Both sides of `/init_weights_update_group` + `/update_weights_from_distributed` use these functions:
the trainer (rank 0) and megarl's CPU engine. They form the group the way SGLang's server does
(rendezvous at `tcp://master_address:master_port`, store keys prefixed with the group name, a
process group of its own beside any default group), so a trainer joins real SGLang servers (NCCL)
and CPU engines (gloo) with the same call. Server i joins with rank `rank_offset` (plus its TP rank).

Bucket layout of `load_format="flattened_bucket"` (SGLang's `FlattenedTensorBucket`): the tensors'
bytes concatenated in `names` order with no padding, so every tensor must start at a byte offset
that is a multiple of its dtype's item size. The trainer broadcasts one uint8 tensor per bucket.
With `load_format=None` it broadcasts each tensor on its own, in `names` order.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)


def init_custom_process_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0) a named process group; blocks until all ranks joined."""
    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = timedelta(seconds=timeout_s)
    init_method = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), PrefixStore(group_name, store), group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_process_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype, as SGLang expects it: `torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in a flattened bucket: bytes [start, end)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def bucket_layout(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> list[TensorSlot]:
    """The byte layout of a flattened bucket; refuses a tensor whose start is not aligned."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
    if not names:
        raise ValueError("a weight bucket must hold at least one tensor")
    slots, offset = [], 0
    for name, dtype_str, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dtype_str)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in tensor {name}: {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"tensor {name} would start at byte {offset}, not aligned to {dtype}; reorder the bucket")
        size = torch.Size(shape).numel() * dtype.itemsize
        slots.append(TensorSlot(name, dtype, shape, offset, offset + size))
        offset += size
    return slots


def flatten_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, dict[str, list]]:
    """Pack tensors into one uint8 tensor; returns it and the request fields `names`, `dtypes`, `shapes`."""
    fields = {
        "names": [n for n, _ in named_tensors],
        "dtypes": [dtype_name(t.dtype) for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
    }
    bucket_layout(fields["names"], fields["dtypes"], fields["shapes"])  # alignment check
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named_tensors])
    return flat, fields


def unflatten_tensors(flat: torch.Tensor, slots: list[TensorSlot]) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` with each slot's dtype and shape."""
    return [(s.name, flat[s.start : s.end].view(s.dtype).reshape(s.shape)) for s in slots]


def receive_bucket(
    group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]], load_format: str | None
) -> list[tuple[str, torch.Tensor]]:
    """Server side: receive one bucket broadcast from rank 0, in either of SGLang's formats."""
    slots = bucket_layout(names, dtypes, shapes)
    if load_format == "flattened_bucket":
        flat = torch.empty(slots[-1].end if slots else 0, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        return unflatten_tensors(flat, slots)
    if load_format is not None:
        raise ValueError(f"load_format {load_format!r} is not supported; use null or 'flattened_bucket'")
    tensors = [(s.name, torch.empty(s.shape, dtype=s.dtype)) for s in slots]
    for _, tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)
    return tensors


def send_bucket(
    group: dist.ProcessGroup, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None
) -> None:
    """Trainer side (rank 0): the broadcasts matching `receive_bucket` on every server."""
    if load_format == "flattened_bucket":
        flat, _ = flatten_tensors(named_tensors)
        dist.broadcast(flat, src=0, group=group)
        return
    for _, tensor in named_tensors:
        dist.broadcast(tensor.detach().contiguous(), src=0, group=group)
