"""Which actor rank shares a GPU with each rollout server's TP rank (colocated placement).

The tensor transport hands SGLang CUDA IPC handles. A handle names memory on one device, and a
process can open it only for memory that lives on a device it can access; SGLang's TP worker r
opens entry r of `serialized_named_tensors` (sglang 0.5.23 `managers/tp_worker.py::
deserialize_own_rank`, "deserializing another rank's copy would break producer-side CUDA-IPC
refcounting"). So entry r must be serialised by a trainer process whose copy of the bucket lives
on TP rank r's own GPU: the actor rank colocated with it. (NCCL, for its part, refuses two ranks of
one communicator on one GPU, which is why colocated servers get no NCCL weight-update group.)

Pure functions of device lists: a device is any hashable (the planner's `Device(node, gpu)`).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence


class ColocationError(ValueError):
    """A server TP rank whose GPU holds no actor rank (or several): no IPC copy can reach it."""


def colocated_peers(actor_devices: Sequence[Hashable],
                    server_devices: Sequence[Sequence[Hashable]]) -> list[list[int]]:
    """For each server, for each of its TP ranks r: the actor rank whose GPU is r's GPU.

    `actor_devices[k]`: actor rank k's GPU; `server_devices[s][r]`: server s's TP rank r's GPU
    (the planner's `RolePlacement.devices` and `server_devices(s)`). Raises `ColocationError` when
    a server GPU holds no actor rank (split placement: use the distributed transport) or several."""
    ranks_on: dict[Hashable, list[int]] = {}
    for rank, device in enumerate(actor_devices):
        ranks_on.setdefault(device, []).append(rank)
    peers = []
    for s, devices in enumerate(server_devices):
        if not devices:
            raise ColocationError(f"server {s} has no GPU")
        row = []
        for r, device in enumerate(devices):
            ranks = ranks_on.get(device, [])
            if len(ranks) != 1:
                what = "no actor rank" if not ranks else f"actor ranks {ranks}"
                raise ColocationError(
                    f"server {s} TP rank {r} is on GPU {device}, which holds {what}: a CUDA IPC handle can only be "
                    "opened on the GPU of the memory it names, so the tensor transport needs exactly one actor "
                    "rank on every server GPU (colocated placement); for servers on other GPUs use the "
                    "'distributed' transport"
                )
            row.append(ranks[0])
        peers.append(row)
    return peers


def planner_colocated_peers(server_tp_sizes: Sequence[int], actor_world_size: int) -> list[list[int]]:
    """`colocated_peers` for the planner's colocated layout (actor and rollout in one pool): the
    pool's GPU g holds actor rank g (megatron's rank order fills the pool) and the servers take
    consecutive runs of `tp` GPUs in server order (`placement.planner`)."""
    total = sum(server_tp_sizes)
    if total != actor_world_size:
        raise ColocationError(
            f"the servers' TP ranks cover {total} GPUs ({list(server_tp_sizes)}) but the actor has "
            f"{actor_world_size} ranks: colocated servers and actor must share the same GPUs"
        )
    starts = [sum(server_tp_sizes[:s]) for s in range(len(server_tp_sizes))]
    return colocated_peers(range(actor_world_size),
                           [range(start, start + tp) for start, tp in zip(starts, server_tp_sizes)])


def checked_peers(peers: Sequence[Sequence[int]], server_tp_sizes: Sequence[int],
                  actor_world_size: int) -> list[list[int]]:
    """`peers` (one row per server, one actor rank per TP rank) if they fit the servers' TP sizes
    and name each actor rank at most once, else `ColocationError`."""
    shape = [len(row) for row in peers]
    if shape != list(server_tp_sizes):
        raise ColocationError(f"colocated peers {list(map(list, peers))} do not fit the servers' TP sizes "
                              f"{list(server_tp_sizes)}")
    ranks = [k for row in peers for k in row]
    if len(set(ranks)) != len(ranks) or not all(0 <= k < actor_world_size for k in ranks):
        raise ColocationError(f"colocated peers {list(map(list, peers))}: each must be a distinct actor rank "
                              f"below {actor_world_size}")
    return [list(row) for row in peers]
