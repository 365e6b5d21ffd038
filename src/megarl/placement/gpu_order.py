"""Which GPU each bundle of a placement group really got, and the plan's devices mapped onto them.

A pool's bundles are `{"GPU": 1}` each, pinned to their planned node; Ray picks which of the
node's GPUs a bundle gets and does not promise that bundle b gets node-local GPU b. Every decision
that names a GPU is therefore made from the GPU each bundle reports (`BundleGpu`), never from the
bundle's index:

- the plan's devices on a node, in plan GPU order, take that node's bundles in the order of the
  GPUs they got (`device_bundles`), so consecutive plan GPUs are consecutive real GPUs wherever
  Ray gave the pool a consecutive run;
- a SGLang server takes `--base-gpu-id` + j for its TP rank j on each node (sglang 0.5.23
  `srt/entrypoints/engine.py`, `_launch_scheduler_processes`: `gpu_id = base_gpu_id + (pp_rank %
  pp_size_per_node) * tp_size_per_node + (tp_rank % tp_size_per_node) * gpu_id_step`; megarl's
  servers have PP 1 and step 1), so the GPUs of its bundles on a node must be exactly that run
  (`server_gpu_problems`), else it would run on GPUs of another rank or role;
- colocated, the actor rank that serialises a server TP rank's CUDA IPC copy is the one on that
  TP rank's real GPU (`real_server_gpus` feeds `megarl.sync.colocation.colocated_peers`).

Pure functions of reports; `ray_pools.create_pools` gathers the reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megarl.placement.planner import Device, RolePlacement


class GpuOrderError(RuntimeError):
    """The GPUs Ray gave a pool cannot host the plan (names the pool, server and GPUs)."""


@dataclass(frozen=True)
class BundleGpu:
    """The GPU one bundle got: its Ray node, Ray's GPU id (a value of the raylet's
    CUDA_VISIBLE_DEVICES, or the physical index when it has none) and its CUDA index in a process
    that sees the raylet's GPUs (`config.devices.visible_gpu_index`; what `--base-gpu-id` and
    `cuda:<i>` count on that node)."""

    node_id: str
    gpu_id: str
    index: int


def device_bundles(pool: str, devices: Sequence[Device], planned_node_ids: Sequence[str],
                   bundles: Sequence[BundleGpu]) -> list[int]:
    """For each plan device i of a pool, the bundle it runs on: on each node the plan's devices in
    plan GPU order take the node's bundles in the order of their GPUs' CUDA index.

    `devices[i]`: the plan's i-th device of the pool; `planned_node_ids[i]`: the Ray node that
    bundle i was pinned to (the plan's node of devices[i]); `bundles[b]`: what bundle b got.
    Raises GpuOrderError if a bundle is not on its planned node or two bundles got one GPU."""
    if not (len(devices) == len(planned_node_ids) == len(bundles)):
        raise GpuOrderError(f"pool {pool}: {len(devices)} devices, {len(planned_node_ids)} planned nodes and "
                            f"{len(bundles)} bundle reports")
    for b, (got, want) in enumerate(zip(bundles, planned_node_ids)):
        if got.node_id != want:
            raise GpuOrderError(f"pool {pool} bundle {b} is on Ray node {got.node_id[:8]}, the plan pinned it to "
                                f"{want[:8]}")
    seen: dict[tuple[str, int], int] = {}
    for b, got in enumerate(bundles):
        if (got.node_id, got.index) in seen:
            raise GpuOrderError(f"pool {pool} bundles {seen[got.node_id, got.index]} and {b} both got GPU "
                                f"{got.gpu_id} of node {got.node_id[:8]}")
        seen[got.node_id, got.index] = b
    order = [0] * len(devices)
    for node in dict.fromkeys(planned_node_ids):
        on_node = [i for i in range(len(devices)) if planned_node_ids[i] == node]
        by_plan = sorted(on_node, key=lambda i: devices[i].gpu)
        by_gpu = sorted(on_node, key=lambda b: bundles[b].index)
        for i, b in zip(by_plan, by_gpu):
            order[i] = b
    return order


def server_gpu_problems(role: RolePlacement, gpus: Sequence[BundleGpu]) -> list[str]:
    """Rollout role: the servers whose GPUs on a node are not the run `--base-gpu-id`,
    `--base-gpu-id` + 1, ... in TP rank order (SGLang's rule, module docstring). `gpus[i]`: the
    real GPU of `role.devices[i]`. Empty when every server can start where its bundles are."""
    problems = []
    for server in range(role.dp):
        ranks = range(server * role.tp, (server + 1) * role.tp)
        for node in dict.fromkeys(gpus[i].node_id for i in ranks):
            on_node = [i for i in ranks if gpus[i].node_id == node]
            got = [gpus[i].index for i in on_node]
            want = list(range(got[0], got[0] + len(got)))
            if got != want:
                problems.append(
                    f"rollout server {server} has GPUs with CUDA index {got} (Ray ids "
                    f"{[gpus[i].gpu_id for i in on_node]}) on node {node[:8]}, but SGLang runs its TP ranks on "
                    f"--base-gpu-id={got[0]} + rank, i.e. {want}: Ray gave the pool GPUs that are not consecutive "
                    "(another job or pool holds the others); free the node's GPUs or use whole nodes per pool")
    return problems


def real_server_gpus(role: RolePlacement, gpus: Sequence[BundleGpu]) -> list[list[tuple[str, int]]]:
    """Rollout role: for each server, for each TP rank j, the (node id, CUDA index) it runs on:
    on each node, its first bundle's GPU + its rank on that node (SGLang's rule, module docstring),
    not the plan's device."""
    out = []
    for server in range(role.dp):
        ranks = list(range(server * role.tp, (server + 1) * role.tp))
        first_on: dict[str, int] = {}
        row = []
        for i in ranks:
            node = gpus[i].node_id
            first_on.setdefault(node, i)
            row.append((node, gpus[first_on[node]].index + (i - first_on[node])))
        out.append(row)
    return out
