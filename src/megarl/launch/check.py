"""The cluster check: prove that the running Ray cluster can host an experiment's placement plan
before the experiment starts, and name the node at fault when it cannot.

It checks that every plan node joined with trainer.n_gpus_per_node GPUs, realises the plan's pools
as placement groups, starts one probe actor per GPU of each pool (a `RankedWorker`, as the real
roles are), checks where each landed (Ray node, Slurm node, GPU id, CUDA_VISIBLE_DEVICES) against
the plan and against the GPU its bundle reported (`placement.gpu_order`: planned and real GPU
side by side; a rollout server whose GPUs are not the run SGLang takes is named), and runs an all-reduce across all of them: NCCL on CUDA tensors when every probe sees its
GPU as a CUDA device (the path the experiment's collectives take, across nodes), gloo on CPU
tensors when none does (`probe_backend`). `check_cluster` needs `ray.init` done;
`check_running_cluster` (`megarl check-cluster`) connects itself.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import ray

from megarl.config import ExperimentConfig
from megarl.launch.ray_nodes import accepts_connections
from megarl.launch.settings import SLURM_NODE_LABEL, SOCKET_IFNAME_VARS, socket_env
from megarl.placement import format_gpu_map, plan_from_config
from megarl.placement.gpu_order import BundleGpu, GpuOrderError, server_gpu_problems
from megarl.placement.planner import Plan, Pool, RolePlacement
from megarl.placement.ray_pools import (
    NODE_RANK_LABEL,
    PlacementTimeout,
    RayNode,
    create_pools,
    gpu_nodes,
)
from megarl.placement.worker_group import JOIN_GRACE_S, WorkerGroup, WorkerGroupError
from megarl.workers.base import RankedWorker

CLUSTER_FAILURE_EXIT = 3  # a Ray node did not join, or the cluster check failed


class ClusterCheckError(RuntimeError):
    """The cluster cannot host the plan. The message names the node(s) at fault."""


class Probe(RankedWorker):
    """Stands in for a role's rank: one per GPU, with a rank across all pools."""

    def __init__(self, rank: int, world_size: int, role: str, rank_offset: int, global_world_size: int):
        super().__init__(rank + rank_offset, global_world_size, role)

    def describe(self) -> dict:
        import torch

        info = self.node_info()
        info["slurm_node"] = os.environ.get("SLURMD_NODENAME")
        info["slurm_gpus"] = os.environ.get("SLURM_STEP_GPUS") or os.environ.get("SLURM_JOB_GPUS")
        info["cuda"] = torch.cuda.is_available()  # Ray set CUDA_VISIBLE_DEVICES to this probe's GPU
        info["socket_env"] = socket_env()
        return info

    def all_reduce_rank(self, backend: str) -> float:
        """Sum over all ranks of (rank + 1); with NCCL on this probe's GPU (device 0 of the one
        Ray made visible)."""
        import torch
        import torch.distributed as dist

        x = torch.tensor([float(self.rank + 1)])
        if backend == "nccl":
            torch.cuda.set_device(0)
            x = x.cuda()
        dist.all_reduce(x)
        return x.item()


def probe_backend(cuda_seen: Sequence[bool]) -> str:
    """The all-reduce backend of the probes, from whether each sees a CUDA device: "nccl" when all
    do (NCCL reduces CUDA tensors only), "gloo" when none does (Ray's logical GPUs on CPU machines).
    A mix is a broken node: ClusterCheckError naming the ranks without CUDA."""
    if all(cuda_seen):
        return "nccl"
    if not any(cuda_seen):
        return "gloo"
    missing = [rank for rank, seen in enumerate(cuda_seen) if not seen]
    raise ClusterCheckError(f"  - rank(s) {missing} see no CUDA device while the others do: a node's driver or "
                            "CUDA_VISIBLE_DEVICES is wrong")


def slurm_names_in_rank_order(nnodes: int) -> tuple[str, ...]:
    """The `slurm-node` labels of Ray nodes 0..nnodes-1, or () unless every one has both labels."""
    names = {}
    for n in ray.nodes():
        rank, name = n["Labels"].get(NODE_RANK_LABEL), n["Labels"].get(SLURM_NODE_LABEL)
        if n["Alive"] and rank is not None and rank.isdigit() and name:
            names[int(rank)] = name
    return tuple(names[k] for k in range(nnodes)) if all(k in names for k in range(nnodes)) else ()


def node_problems(plan: Plan, ray_nodes: list[dict]) -> list[str]:
    """Every plan node joined, under its name, with trainer.n_gpus_per_node GPUs. `ray_nodes` is
    what `ray.nodes()` returns."""
    cluster, problems = plan.cluster, []
    alive = [n for n in ray_nodes if n["Alive"]]
    by_rank = {int(n["Labels"][NODE_RANK_LABEL]): n for n in alive
               if n["Labels"].get(NODE_RANK_LABEL, "").isdigit()}
    if not by_rank:  # a cluster megarl's launchers did not start: plan node k = k-th GPU node by id
        found = len([n for n in alive if n["Resources"].get("GPU", 0) > 0])
        if found < cluster.nnodes:
            problems.append(f"Ray has {found} node(s) with GPUs; the plan needs trainer.nnodes={cluster.nnodes}")
        return problems
    for k in range(cluster.nnodes):
        name, node = cluster.name(k), by_rank.get(k)
        if node is None:
            problems.append(f"plan node {k} ({name}) has not joined the Ray cluster "
                            f"(joined: {sorted(by_rank)} = {[_label_name(by_rank[r]) for r in sorted(by_rank)]})")
            continue
        label = node["Labels"].get(SLURM_NODE_LABEL)
        if cluster.node_names and label and label != name:
            problems.append(f"plan node {k} should be {name}, but the Ray node with {NODE_RANK_LABEL}={k} is "
                            f"labelled {SLURM_NODE_LABEL}={label}")
        gpus = node["Resources"].get("GPU", 0)
        if gpus != cluster.gpus_per_node:
            hint = " (Ray detects 0 GPUs unless `ray start` is given --num-gpus)" if not gpus else ""
            problems.append(f"node {name} has {gpus:g} GPU(s) in Ray but trainer.n_gpus_per_node="
                            f"{cluster.gpus_per_node}{hint}")
    return problems


def _label_name(node: dict) -> str:
    return node["Labels"].get(SLURM_NODE_LABEL) or node["NodeID"][:8]


def _probe_role(pool: Pool) -> RolePlacement:
    """One rank per GPU of the pool, each holding a whole GPU."""
    return RolePlacement(f"probe[{pool.name}]", pool.name, "train", tp=1, pp=1, cp=1, dp=len(pool.devices),
                         devices=list(pool.devices), gpu_fraction=1.0)


def _on_all(groups: list[WorkerGroup], method: Callable, *args, timeout_s: float) -> list[list]:
    """The probes' `method` on every rank of every group at once (a collective must reach all ranks)."""
    with ThreadPoolExecutor(len(groups)) as pool:
        futures = [pool.submit(g.call, method, *args, timeout_s=timeout_s) for g in groups]
        return [f.result() for f in futures]


def _run_probes(plan: Plan, nodes: list[RayNode],
                timeout_s: float) -> tuple[list[str], list[dict], list[BundleGpu], str, list[float]]:
    """Realise the plan's pools, one probe per GPU, an all-reduce over all of them: (problems
    with the bundles' nodes and the servers' GPUs, each rank's `Probe.describe()`, the GPU each
    rank's bundle reported, the backend, each rank's all-reduce result)."""
    try:
        pools = create_pools(plan, timeout_s=timeout_s)
    except (PlacementTimeout, GpuOrderError) as exc:
        raise ClusterCheckError(f"  - {exc}") from exc
    problems, groups = [], []
    try:
        for pool in plan.pools.values():
            planned = [nodes[d.node].node_id for d in pool.devices]
            for b, (got, want) in enumerate(zip(pools.bundle_node_ids(pool.name), planned, strict=True)):
                if got != want:
                    problems.append(f"pool {pool.name} bundle {b} is on Ray node {got[:8]}, the plan says "
                                    f"{nodes[pool.devices[b].node].name}")
        real = [pools.device_gpu(pool.name, i) for pool in plan.pools.values() for i in range(len(pool.devices))]
        rollout = plan.roles.get("rollout")
        if rollout is not None:
            problems += server_gpu_problems(rollout, [pools.device_gpu(rollout.pool, i)
                                                      for i in range(rollout.world_size)])
        world, offset = sum(len(p.devices) for p in plan.pools.values()), 0
        for pool in plan.pools.values():
            groups.append(WorkerGroup(Probe, _probe_role(pool), pools, offset, world))
            offset += len(pool.devices)
        infos = [info for per_group in _on_all(groups, Probe.describe, timeout_s=timeout_s) for info in per_group]
        backend = probe_backend([info["cuda"] for info in infos])
        addr, port = groups[0].call_ranks([0], Probe.master_address, timeout_s, timeout_s=timeout_s)[0]
        _on_all(groups, Probe.init_process_group, addr, port, backend, timeout_s, timeout_s=timeout_s + JOIN_GRACE_S)
        sums = [s for per_group in _on_all(groups, Probe.all_reduce_rank, backend, timeout_s=timeout_s)
                for s in per_group]
    except WorkerGroupError as exc:
        raise ClusterCheckError(f"  - {exc}") from exc
    finally:
        for group in groups:
            group.shutdown()
        pools.remove()
    return problems, infos, real, backend, sums


def _rank_problems(plan: Plan, nodes: list[RayNode], infos: list[dict], real: list[BundleGpu],
                   expected_sockets: dict[str, str]) -> list[str]:
    """Each rank on its planned node (by Ray node id and by the Slurm node its process sees),
    on the GPU its bundle reported (`real`, what every GPU decision is made from), one of its own
    that Slurm gave the job, visible as itself, with the launcher's socket interface variables."""
    problems, seen = [], {}
    devices = [(pool.name, d) for pool in plan.pools.values() for d in pool.devices]
    for rank, ((pool_name, d), info, want) in enumerate(zip(devices, infos, real, strict=True)):
        planned, name, gpu = nodes[d.node], plan.cluster.name(d.node), ",".join(info["gpu_ids"])
        where = f"rank {rank} (pool {pool_name}, plan node {d.node} = {name})"
        if info["node_id"] != planned.node_id:
            problems.append(f"{where} runs on Ray node {info['node_id'][:8]}, not on {planned.name}")
        if info["gpu_ids"] != [want.gpu_id]:
            problems.append(f"{where} runs on GPU {gpu}, but its bundle reported GPU {want.gpu_id}: Ray moved it")
        if plan.cluster.node_names and info["slurm_node"] and info["slurm_node"] != name:
            problems.append(f"{where} runs on Slurm node {info['slurm_node']}: the Ray node labelled {name} is on "
                            f"another Slurm node")
        if len(info["gpu_ids"]) != 1 or info["cuda_visible_devices"] != gpu:
            problems.append(f"{where} has GPU ids {info['gpu_ids']} and CUDA_VISIBLE_DEVICES="
                            f"{info['cuda_visible_devices']}; expected one GPU, visible as itself")
        if info["slurm_gpus"] and not set(info["gpu_ids"]) <= set(info["slurm_gpus"].split(",")):
            problems.append(f"{where} got GPU {gpu}, which Slurm did not give this job on {name} "
                            f"(SLURM_STEP_GPUS={info['slurm_gpus']})")
        if info["socket_env"] != expected_sockets:
            problems.append(f"{where} has socket interfaces {info['socket_env']}, the launcher {expected_sockets}: "
                            f"{', '.join(SOCKET_IFNAME_VARS)} must reach every worker")
        if (info["node_id"], gpu) in seen:
            problems.append(f"{where} shares GPU {gpu} of {name} with rank {seen[info['node_id'], gpu]}")
        seen[info["node_id"], gpu] = rank
    return problems


def _format_map(plan: Plan, infos: list[dict], real: list[BundleGpu]) -> list[str]:
    """One line per rank: planned node and GPU beside the real ones (Ray's GPU id, and its CUDA
    index among the node's GPUs, what `--base-gpu-id` counts). Planned and real GPU indexes may
    differ (Ray picks a bundle's GPU); every GPU decision uses the real one."""
    lines = [f"{'pool':<10} {'rank':>4}  {'plan node':<14} {'plan GPU':>8} {'Ray node':<10} {'Slurm node':<12} "
             f"{'GPU':>4} {'index':>5}  CUDA_VISIBLE_DEVICES"]
    devices = [(pool.name, d) for pool in plan.pools.values() for d in pool.devices]
    for rank, ((pool_name, d), info, gpu) in enumerate(zip(devices, infos, real, strict=True)):
        lines.append(f"{pool_name:<10} {rank:>4}  {f'{d.node} ({plan.cluster.name(d.node)})':<14} {d.gpu:>8} "
                     f"{info['node_id'][:8]:<10} {info['slurm_node'] or '-':<12} {','.join(info['gpu_ids']):>4} "
                     f"{gpu.index:>5}  {info['cuda_visible_devices']}")
    return lines


def check_cluster(plan: Plan, timeout_s: float = 120.0, log=print) -> None:
    """Realise `plan` with probes and verify it; logs the realised map. Raises ClusterCheckError."""
    t0 = time.monotonic()
    problems = node_problems(plan, ray.nodes())
    if problems:
        raise ClusterCheckError("\n".join(f"  - {p}" for p in problems))
    nodes: list[RayNode] = gpu_nodes()[:plan.cluster.nnodes]
    problems, infos, real, backend, sums = _run_probes(plan, nodes, timeout_s)
    for line in _format_map(plan, infos, real):
        log(line)
    sockets = socket_env()
    problems += _rank_problems(plan, nodes, infos, real, sockets)
    world = len(infos)
    expected = world * (world + 1) / 2
    if any(s != expected for s in sums):
        problems.append(f"{backend} all-reduce of (rank + 1) gave {sorted(set(sums))}, expected {expected:g}")
    if problems:
        raise ClusterCheckError("\n".join(f"  - {p}" for p in problems))
    names = [plan.cluster.name(k) for k in range(plan.cluster.nnodes)]
    log(f"cluster check OK: {plan.cluster.nnodes} node(s) {names} x {plan.cluster.gpus_per_node} GPU(s); "
        f"{backend} all-reduce over {world} ranks = {expected:g}; socket interfaces on every rank: "
        f"{' '.join(f'{k}={v}' for k, v in sockets.items()) or 'none set'}; {time.monotonic() - t0:.1f} s")


def check_running_cluster(config: ExperimentConfig, node_names: tuple[str, ...] = (), timeout_s: float = 180.0,
                          log=print) -> int:
    """`megarl check-cluster`: connect to the cluster at RAY_ADDRESS (what megarl's launchers set;
    never whichever Ray happens to run on this machine), plan with the given node names (default:
    the Slurm names on the Ray nodes' labels), print the plan and check it. Returns 0, or
    CLUSTER_FAILURE_EXIT with one line saying why."""
    address = os.environ.get("RAY_ADDRESS", "")
    if not address:
        log("cluster check FAILED: RAY_ADDRESS is not set. megarl check-cluster checks the cluster a megarl "
            "launcher started (launch/local.sh and slurm/megarl.sbatch set RAY_ADDRESS for the experiment); "
            "to check another, set RAY_ADDRESS=<head ip>:<port>")
        return CLUSTER_FAILURE_EXIT
    host, _, port = address.rpartition(":")
    if port.isdigit() and not accepts_connections(host, int(port)):
        log(f"cluster check FAILED: no Ray cluster answers at RAY_ADDRESS={address}")
        return CLUSTER_FAILURE_EXIT
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError) as error:
        log(f"cluster check FAILED: cannot join the Ray cluster at RAY_ADDRESS={address}: "
            f"{(str(error).splitlines() or [''])[0]}")
        return CLUSTER_FAILURE_EXIT
    try:
        names = tuple(node_names) or slurm_names_in_rank_order(config.trainer.nnodes)
        plan = plan_from_config(config, node_names=names)
        log(f"placement plan:\n{format_gpu_map(plan)}")
        check_cluster(plan, timeout_s=timeout_s, log=log)
    except ClusterCheckError as exc:
        log(f"cluster check FAILED:\n{exc}")
        return CLUSTER_FAILURE_EXIT
    finally:
        ray.shutdown()
    return 0
