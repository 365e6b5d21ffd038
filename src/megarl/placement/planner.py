"""The placement planner: a pure function from a cluster and role sizes to a GPU map.

A *pool* is a contiguous run of GPUs in (node, gpu) order. Roles in one pool time-share its GPUs
(colocated); roles in different pools never share a GPU (split). Rank r of a training role with
parallel sizes TP x CP x PP x DP sits on the pool's r-th GPU, in megatron-core's default rank
order (TP fastest, then CP, then DP, then PP), so a TP group is a run of consecutive GPUs and
must not cross a node boundary. A CP group is the CP ranks TP apart inside one run of TP x CP
consecutive GPUs (ranks b + t, b + t + TP, ..., b + t + (CP - 1) x TP); it may cross a node
boundary: megatron-core knows no nodes and refuses no CP layout, its p2p ring (the default
`cp_comm_type`) overlaps each K/V exchange with attention compute, and its hierarchical `a2a+p2p`
exists for CP across nodes (p2p between them); the plan's layout says when a CP group spans nodes.
A rollout server's TP group is a run of consecutive GPUs too: inside one node, or (real SGLang,
`--nnodes`) whole nodes, one server process per node.
Expert parallelism adds no GPU: megatron lays a training role's EP x ETP ranks over its
TP x CP x DP ranks of each stage, SGLang a server's EP ranks over its TP ranks.

Plans are plain data (dataclasses); nothing here talks to Ray.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

from megarl.config import ConfigError


class PlanError(ConfigError):
    """An impossible layout. The message names the config keys to change."""


@dataclass(frozen=True)
class ClusterSpec:
    nnodes: int
    gpus_per_node: int
    node_names: tuple[str, ...] = ()  # optional labels (e.g. Slurm node names), one per node

    def name(self, node: int) -> str:
        return self.node_names[node] if self.node_names else f"node{node}"


@dataclass(frozen=True)
class RoleSpec:
    """One role's shape. Training roles use tp/pp/cp and fill their pool with data parallelism;
    a rollout role runs pool_gpus / tp servers of `tp` GPUs each. `ep`: the ranks an MoE layer's
    experts are split over (a training role's `etp`, expert TP, None: its TP; a server's MoE TP is
    tp / ep). `attn_dp`: a server's attention groups (SGLang's --attn-dp-size), tp / attn_dp GPUs each,
    inside its `tp` GPUs."""

    name: str
    pool: str
    kind: str  # "train" or "rollout"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    attn_dp: int = 1
    tp_key: str = ""  # config key to name in errors
    pp_key: str = ""
    ep_key: str = ""


@dataclass(frozen=True)
class Device:
    node: int
    gpu: int  # index within the node


@dataclass
class Pool:
    name: str
    devices: list[Device]
    roles: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> list[int]:
        return sorted({d.node for d in self.devices})


@dataclass
class RolePlacement:
    name: str
    pool: str
    kind: str
    tp: int
    pp: int
    cp: int
    dp: int  # training: data-parallel size; rollout: number of servers
    devices: list[Device]  # one per rank (training) or per server GPU (rollout), in rank order
    gpu_fraction: float  # of one GPU, for the Ray actor of one rank (1 / roles sharing the GPU)
    ep: int = 1  # expert parallel size (RoleSpec.ep)
    etp: int = 1  # training: expert tensor parallel size
    attn_dp: int = 1  # rollout: attention groups per server (RoleSpec.attn_dp)

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def layout(self) -> str:
        """'TP 1 x CP 1 x PP 2 x DP 8' (training) or '4 server(s) of TP 4' (rollout), with the experts'
        layout over the same GPUs where EP > 1: megatron's EP x ETP x expert-DP, expert-DP = TP x CP x DP /
        (EP x ETP) (megatron-core parallel_state.py: world / (ETP x EP x PP)), or SGLang's EP x MoE TP,
        MoE TP = TP / EP (0.5.23 runtime_context.derive_parallel_widths); a server's attention layout
        where attention DP > 1: attention DP x attention TP, attention TP = TP / attention DP
        (runtime_context.derive_attn_tp_size)."""
        if self.kind == "rollout":
            attention = (f" (attention: DP {self.attn_dp} x TP {self.tp // self.attn_dp})" if self.attn_dp > 1
                         else "")
            experts = f" (experts: EP {self.ep} x MoE TP {self.tp // self.ep})" if self.ep > 1 else ""
            return f"{self.dp} server(s) of TP {self.tp}{attention}{experts}"
        shape = f"TP {self.tp} x CP {self.cp} x PP {self.pp} x DP {self.dp}"
        if self.ep > 1:
            expert_dp = self.tp * self.cp * self.dp // (self.ep * self.etp)
            shape += f" (experts: EP {self.ep} x ETP {self.etp} x expert-DP {expert_dp})"
        if self.cp_spans_nodes():
            shape += " (CP groups span nodes: their K/V ring crosses the inter-node network)"
        return shape

    def cp_groups(self) -> list[list[Device]]:
        """Training only: each context-parallel group's GPUs in CP rank order (megatron-core's rank
        order, TP fastest then CP: the ranks TP apart inside each run of TP x CP ranks)."""
        run = self.tp * self.cp
        return [[self.devices[start + t + k * self.tp] for k in range(self.cp)]
                for start in range(0, self.world_size, run) for t in range(self.tp)]

    def cp_spans_nodes(self) -> bool:
        """Whether a CP group crosses a node boundary (allowed; see the module docstring)."""
        return self.cp > 1 and any(len({d.node for d in group}) > 1 for group in self.cp_groups())

    def server_devices(self, server: int) -> list[Device]:
        """Rollout only: the GPUs of server `server`."""
        return self.devices[server * self.tp:(server + 1) * self.tp]

    def server_processes(self) -> list[tuple[int, int, int]]:
        """Rollout only: (server, node rank within the server, index in `devices` of its first GPU
        on that node) of every server process, in order: one per node a server spans, node rank 0
        first (the one that serves HTTP)."""
        out = []
        for server in range(self.dp):
            seen: list[int] = []
            for i in range(server * self.tp, (server + 1) * self.tp):
                if self.devices[i].node not in seen:
                    seen.append(self.devices[i].node)
                    out.append((server, len(seen) - 1, i))
        return out


@dataclass
class Plan:
    cluster: ClusterSpec
    pools: dict[str, Pool]
    roles: dict[str, RolePlacement]

    def occupants(self) -> dict[Device, list[tuple[str, int]]]:
        """GPU -> the (role, rank) pairs placed on it."""
        out: dict[Device, list[tuple[str, int]]] = defaultdict(list)
        for role in self.roles.values():
            for rank, device in enumerate(role.devices):
                out[device].append((role.name, rank))
        return out


def _check_groups_within_nodes(devices: list[Device], size: int, what: str, key: str, cluster: ClusterSpec) -> None:
    for start in range(0, len(devices), size):
        group = devices[start:start + size]
        nodes = {d.node for d in group}
        if len(nodes) > 1:
            names = ", ".join(cluster.name(n) for n in sorted(nodes))
            raise PlanError(
                f"{what}: a group of {size} GPUs (ranks {start}..{start + size - 1}) would span nodes {names}. "
                f"{key}={size} must divide trainer.n_gpus_per_node={cluster.gpus_per_node} and the pool must start "
                f"on a multiple of it; try {key}={_largest_divisor(cluster.gpus_per_node, size)}"
            )


def _check_servers_span_whole_nodes(devices: list[Device], role: RoleSpec, cluster: ClusterSpec) -> None:
    """A rollout server larger than a node takes whole nodes: TP a multiple of the node size and
    each server starting on a node's first GPU."""
    per_node = cluster.gpus_per_node
    if role.tp % per_node:
        raise PlanError(
            f"{role.name} server: {role.tp_key}={role.tp} spans nodes, so it must be a multiple of "
            f"trainer.n_gpus_per_node={per_node} (try {role.tp - role.tp % per_node})"
        )
    for start in range(0, len(devices), role.tp):
        if devices[start].gpu != 0:
            raise PlanError(
                f"{role.name} server {start // role.tp} would start on gpu{devices[start].gpu} of "
                f"{cluster.name(devices[start].node)}: a server of {role.tp_key}={role.tp} GPUs takes whole nodes, so "
                f"its pool must start on a node boundary (with placement.mode=split, make placement.rollout_gpus a "
                f"multiple of trainer.n_gpus_per_node={per_node})"
            )


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def plan_placement(cluster: ClusterSpec, pool_sizes: dict[str, int], roles: list[RoleSpec]) -> Plan:
    """Cut the cluster into pools (in the order given, each a contiguous run of GPUs) and place
    every role's ranks on its pool. Raises PlanError naming the keys to change."""
    if cluster.nnodes < 1 or cluster.gpus_per_node < 1:
        raise PlanError(f"trainer.nnodes={cluster.nnodes} and trainer.n_gpus_per_node={cluster.gpus_per_node} must be >= 1")
    if cluster.node_names and len(cluster.node_names) != cluster.nnodes:
        raise PlanError(f"{len(cluster.node_names)} node names given for trainer.nnodes={cluster.nnodes}")
    total = cluster.nnodes * cluster.gpus_per_node
    wanted = sum(pool_sizes.values())
    if wanted > total:
        sizes = ", ".join(f"{k}={v}" for k, v in pool_sizes.items())
        raise PlanError(
            f"the pools need {wanted} GPUs ({sizes}) but trainer.nnodes x trainer.n_gpus_per_node = "
            f"{cluster.nnodes} x {cluster.gpus_per_node} = {total}"
        )
    all_devices = [Device(n, g) for n in range(cluster.nnodes) for g in range(cluster.gpus_per_node)]
    pools, offset = {}, 0
    for name, size in pool_sizes.items():
        if size < 1:
            raise PlanError(f"pool '{name}' has {size} GPUs; every pool needs at least one")
        pools[name] = Pool(name, all_devices[offset:offset + size])
        offset += size

    sharing: dict[Device, int] = {}
    for role in roles:
        if role.pool not in pools:
            raise PlanError(f"role '{role.name}' names pool '{role.pool}', which does not exist ({list(pools)})")
        pools[role.pool].roles.append(role.name)
        for d in pools[role.pool].devices:
            sharing[d] = sharing.get(d, 0) + 1

    placed = {}
    for role in roles:
        devices = pools[role.pool].devices
        size = len(devices)
        if role.kind == "rollout":
            if size % role.tp:
                raise PlanError(
                    f"{role.name}: {role.tp_key}={role.tp} GPUs per server does not divide the {size} GPUs of pool "
                    f"'{role.pool}'; try {role.tp_key}={_largest_divisor(size, role.tp)}"
                )
            if role.tp > cluster.gpus_per_node:
                _check_servers_span_whole_nodes(devices, role, cluster)
            else:
                _check_groups_within_nodes(devices, role.tp, f"{role.name} server", role.tp_key, cluster)
            if role.ep < 1 or role.tp % role.ep:
                raise PlanError(f"{role.name}: {role.ep_key}={role.ep} must divide {role.tp_key}={role.tp} (a server "
                                "splits its experts over its own TP ranks)")
            dp = size // role.tp
            etp = 1
        else:
            replica = role.tp * role.cp * role.pp
            if replica > size:
                raise PlanError(
                    f"{role.name}: one model replica needs TP x CP x PP = {role.tp} x {role.cp} x {role.pp} = {replica} "
                    f"GPUs but pool '{role.pool}' has {size}; lower {role.tp_key} / {role.pp_key} or give the pool more GPUs"
                )
            if size % replica:
                raise PlanError(
                    f"{role.name}: TP x CP x PP = {replica} GPUs per replica does not divide the {size} GPUs of pool "
                    f"'{role.pool}'; change {role.tp_key} / {role.pp_key} or the pool size"
                )
            _check_groups_within_nodes(devices, role.tp, f"{role.name} TP group", role.tp_key, cluster)
            dp = size // replica
            etp = role.tp if role.etp is None else role.etp
        fraction = 1.0 / max(sharing[d] for d in devices)
        placed[role.name] = RolePlacement(role.name, role.pool, role.kind, role.tp, role.pp, role.cp, dp,
                                          list(devices), fraction, role.ep, etp, role.attn_dp)
    return Plan(cluster, pools, placed)


def format_gpu_map(plan: Plan) -> str:
    """Node by node, GPU by GPU: which role and rank sits where."""
    pool_of = {d: p.name for p in plan.pools.values() for d in p.devices}
    occupants = plan.occupants()
    lines = []
    for node in range(plan.cluster.nnodes):
        lines.append(f"{plan.cluster.name(node)}:")
        for gpu in range(plan.cluster.gpus_per_node):
            d = Device(node, gpu)
            pool = pool_of.get(d)
            if pool is None:
                lines.append(f"  gpu{gpu}: (unused)")
                continue
            parts = []
            for role, rank in occupants[d]:
                r = plan.roles[role]
                parts.append(f"{role} server {rank // r.tp}" if r.kind == "rollout" else f"{role} rank {rank}")
            lines.append(f"  gpu{gpu}: [{pool}] " + ", ".join(parts))
    return "\n".join(lines)
