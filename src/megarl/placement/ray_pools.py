"""Realise a plan's pools as Ray placement groups: one group per pool, one {"GPU": 1} bundle per
GPU, bundle i on the node the plan gives the pool's i-th GPU.

Plan node k is the k-th alive Ray node with GPUs, ordered by the `megarl-node-rank` label when the
launcher sets it (the Slurm scripts do) and by node id otherwise. Nodes are never keyed by IP:
simulated nodes, and some clusters, share one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group

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
    """The placement groups of a plan, and the Ray node behind each plan node."""

    groups: dict[str, PlacementGroup]
    nodes: list[RayNode]

    def bundle_node_ids(self, pool: str) -> list[str]:
        """Ray node id of each bundle of `pool`, read back from Ray (not from the plan)."""
        table = placement_group_table(self.groups[pool])["bundles_to_node_id"]
        return [table[i] for i in range(len(table))]

    def remove(self) -> None:
        for group in self.groups.values():
            remove_placement_group(group)
        self.groups = {}


def create_pools(plan: Plan, timeout_s: float = 60.0) -> RealisedPools:
    """One placement group per pool, each bundle pinned to its planned node; waits until ready."""
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
    for name, group in groups.items():
        # in slices: inside Ray's wait Python runs no signal handler, so Ctrl-C would wait for the timeout
        ready = group.wait(min(1.0, timeout_s))
        while not ready and time.monotonic() < deadline:
            ready = group.wait(min(1.0, max(0.1, deadline - time.monotonic())))
        if not ready:
            realised.remove()
            raise PlacementTimeout(
                f"placement group for pool '{name}' ({len(plan.pools[name].devices)} GPUs on "
                f"{[nodes[n].name for n in plan.pools[name].nodes]}) not ready after {timeout_s:.0f} s: "
                "the GPUs are taken or a node is gone"
            )
    return realised
