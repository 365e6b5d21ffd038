"""Realise a plan's pools as Ray placement groups: one group per pool, one {"GPU": 1} bundle per
GPU, bundle i on the node the plan gives the pool's i-th GPU. Which of the node's GPUs a bundle
got is Ray's choice: each bundle is asked (`probe_bundle_gpus`), and the plan's devices are mapped
onto bundles by those GPUs (`gpu_order.device_bundles`), never by bundle index.

Plan node k is the k-th alive Ray node with GPUs, ordered by the `megarl-node-rank` label when the
launcher sets it (the Slurm scripts do) and by node id otherwise. Nodes are never keyed by IP:
simulated nodes, and some clusters, share one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import os

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.config.devices import visible_gpu_index
from megarl.placement.gpu_order import BundleGpu, device_bundles
from megarl.placement.planner import Plan

NODE_RANK_LABEL = "megarl-node-rank"
NODE_ID_LABEL = "ray.io/node-id"


class PlacementTimeout(RuntimeError):
    pass


@dataclass(frozen=True)
class RayNode:
    node_id: str
    name: str  # the node-rank label, Slurm node name label, or a short node id
    gpus: float


def gpu_nodes() -> list[RayNode]:
    """Alive Ray nodes that have GPUs, in plan order."""
    nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0]

    def key(n):
        rank = n["Labels"].get(NODE_RANK_LABEL)
        return (0, int(rank), "") if rank is not None and rank.isdigit() else (1, 0, n["NodeID"])

    out = []
    for n in sorted(nodes, key=key):
        labels = n["Labels"]
        name = labels.get("slurm-node") or (f"node{labels[NODE_RANK_LABEL]}" if NODE_RANK_LABEL in labels
                                            else n["NodeID"][:8])
        out.append(RayNode(n["NodeID"], name, n["Resources"]["GPU"]))
    return out


@dataclass
class RealisedPools:
    """The placement groups of a plan, the Ray node behind each plan node, the GPU each bundle got
    (`bundle_gpus[pool][b]`) and the bundle of each plan device (`device_bundle[pool][i]`)."""

    groups: dict[str, PlacementGroup]
    nodes: list[RayNode]
    bundle_gpus: dict[str, list[BundleGpu]] = field(default_factory=dict)
    device_bundle: dict[str, list[int]] = field(default_factory=dict)

    def bundle_of(self, pool: str, device: int) -> int:
        """The bundle that the pool's plan device `device` (its index in `Pool.devices`) runs on."""
        return self.device_bundle[pool][device]

    def device_gpu(self, pool: str, device: int) -> BundleGpu:
        """The GPU the pool's plan device `device` really runs on."""
        return self.bundle_gpus[pool][self.bundle_of(pool, device)]

    def bundle_node_ids(self, pool: str) -> list[str]:
        """Ray node id of each bundle of `pool`, read back from Ray (not from the plan)."""
        table = placement_group_table(self.groups[pool])["bundles_to_node_id"]
        return [table[i] for i in range(len(table))]

    def remove(self) -> None:
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups = {}


def create_pools(plan: Plan, timeout_s: float = 60.0) -> RealisedPools:
    """One placement group per pool, each bundle pinned to its planned node; waits until ready,
    then asks every bundle which GPU it got and maps the plan's devices onto bundles by it."""
    nodes = gpu_nodes()
    used = sorted({d.node for p in plan.pools.values() for d in p.devices})
    if len(nodes) <= used[-1]:
        raise PlacementTimeout(
            f"the plan uses {used[-1] + 1} nodes (trainer.nnodes) but Ray has {len(nodes)} alive node(s) with GPUs: "
            f"{[n.name for n in nodes]}. Did every node join, and was `ray start` given --num-gpus?"
        )
    short = [n.name for n in nodes[: used[-1] + 1] if n.gpus < plan.cluster.gpus_per_node]
    if short:
        raise PlacementTimeout(
            f"node(s) {short} have fewer GPUs than trainer.n_gpus_per_node={plan.cluster.gpus_per_node}"
        )
    groups = {}
    for name, pool in plan.pools.items():
        groups[name] = placement_group(
            [{"GPU": 1}] * len(pool.devices),
            strategy="PACK",
            name=f"megarl-{name}",
            bundle_label_selector=[{NODE_ID_LABEL: nodes[d.node].node_id} for d in pool.devices],
        )
    realised = RealisedPools(groups, nodes)
    deadline = time.monotonic() + timeout_s
    try:
        _wait_ready(plan, realised, deadline, timeout_s)
        for name, pool in plan.pools.items():
            gpus = probe_bundle_gpus(groups[name], len(pool.devices), max(1.0, deadline - time.monotonic()))
            realised.bundle_gpus[name] = gpus
            realised.device_bundle[name] = device_bundles(name, pool.devices,
                                                          [nodes[d.node].node_id for d in pool.devices], gpus)
    except BaseException:
        realised.remove()
        raise
    return realised


def _wait_ready(plan: Plan, realised: RealisedPools, deadline: float, timeout_s: float) -> None:
    groups, nodes = realised.groups, realised.nodes
    for name, group in groups.items():
        # in slices: inside Ray's wait Python runs no signal handler, so Ctrl-C would wait for the timeout
        ready = group.wait(min(1.0, timeout_s))
        while not ready and time.monotonic() < deadline:
            ready = group.wait(min(1.0, max(0.1, deadline - time.monotonic())))
        if not ready:
            raise PlacementTimeout(
                f"placement group for pool '{name}' ({len(plan.pools[name].devices)} GPUs on "
                f"{[nodes[n].name for n in plan.pools[name].nodes]}) not ready after {timeout_s:.0f} s: "
                "the GPUs are taken or a node is gone"
            )


@ray.remote(num_cpus=0)
def _bundle_gpu() -> tuple[str, str, int]:
    """(node id, Ray's GPU id, CUDA index among the raylet's GPUs) of the bundle this task runs in."""
    ids = ray.get_gpu_ids()
    return (ray.get_runtime_context().get_node_id(), str(ids[0]),
            visible_gpu_index(ids, os.environ.get("CUDA_VISIBLE_DEVICES")))


def probe_bundle_gpus(group: PlacementGroup, bundles: int, timeout_s: float) -> list[BundleGpu]:
    """Ask each bundle of `group` which GPU it got: a task on a sliver of the bundle's GPU, seeing the
    raylet's CUDA_VISIBLE_DEVICES (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, as the SGLang
    servers do) so that its index counts as `--base-gpu-id` does. A bundle's GPU is fixed when
    the group is made, so every actor later placed in it gets the same one."""
    refs = [
        _bundle_gpu.options(
            num_gpus=0.01,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b),
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        ).remote()
        for b in range(bundles)
    ]
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending and time.monotonic() < deadline:  # in slices, so Ctrl-C is handled while it waits
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, max(0.1, deadline - time.monotonic())))
    if pending:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise PlacementTimeout(f"{len(pending)} of {bundles} bundles did not say which GPU they got within "
                               f"{timeout_s:.0f} s")
    return [BundleGpu(*ray.get(ref)) for ref in refs]
