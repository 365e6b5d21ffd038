"""The plan realised on a real Ray cluster of simulated nodes with logical GPUs."""
import os
import time

import pytest

ray = pytest.importorskip("ray")  # a core dependency: present whenever megarl is installed
from ray.cluster_utils import Cluster  # noqa: E402

from megarl.placement import ClusterSpec, RoleSpec, plan_placement  # noqa: E402
from megarl.placement.ray_pools import NODE_RANK_LABEL, PlacementTimeout, create_pools  # noqa: E402
from megarl.placement.worker_group import WorkerGroup, WorkerGroupError  # noqa: E402
from megarl.workers.base import RankedWorker  # noqa: E402

NODES, GPUS = 2, 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"  # same for head, nodes and driver (see ray-and-slurm-on-cpu.md)
    temp = tmp_path_factory.mktemp("ray")
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, num_gpus=0, include_dashboard=False,
                                                          temp_dir=str(temp)))
    # Added in reverse so that plan order (by node-rank label) differs from start order.
    for rank in reversed(range(NODES)):
        c.add_node(num_cpus=2, num_gpus=GPUS, labels={NODE_RANK_LABEL: str(rank)})
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    node_rank = {n["NodeID"]: int(n["Labels"][NODE_RANK_LABEL]) for n in ray.nodes() if NODE_RANK_LABEL in n["Labels"]}
    yield node_rank
    ray.shutdown()
    c.shutdown()


class Probe(RankedWorker):
    def all_reduce_rank(self) -> float:
        import torch
        import torch.distributed as dist

        x = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(x)
        return x.item()

    def sleep(self, seconds: float) -> bool:
        time.sleep(seconds)
        return True

    def die_on(self, rank: int) -> bool:
        if self.rank == rank:
            os._exit(1)
        return True

    def fail_on(self, rank: int) -> bool:
        if self.rank == rank:
            raise ValueError(f"bad input on rank {rank}")
        return True


def train(name, pool, tp=1):
    return RoleSpec(name, pool, "train", tp=tp)


def test_colocated_roles_share_gpus_and_bundles_land_on_planned_nodes(cluster):
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"shared": NODES * GPUS},
                          [train("actor", "shared"), RoleSpec("rollout", "shared", "rollout", tp=2)])
    pools = create_pools(plan, timeout_s=60)
    try:
        bundle_nodes = [cluster[n] for n in pools.bundle_node_ids("shared")]
        assert bundle_nodes == [d.node for d in plan.pools["shared"].devices]
        actors = WorkerGroup(Probe, plan.roles["actor"], pools)
        rollouts = WorkerGroup(Probe, plan.roles["rollout"], pools)
        a_info = actors.call("node_info", timeout_s=60)
        r_info = rollouts.call("node_info", timeout_s=60)
        assert len(a_info) == 8 and len(r_info) == 4
        for rank, info in enumerate(a_info):
            assert cluster[info["node_id"]] == plan.roles["actor"].devices[rank].node
        for server, info in enumerate(r_info):
            twin = a_info[server * 2]  # the actor rank on the server's first GPU
            assert (info["node_id"], info["gpu_ids"]) == (twin["node_id"], twin["gpu_ids"])
            assert info["cuda_visible_devices"] == twin["cuda_visible_devices"]
        # within a node, the actor ranks use distinct GPUs
        for node in range(NODES):
            ids = [i["gpu_ids"][0] for i in a_info if cluster[i["node_id"]] == node]
            assert len(ids) == GPUS == len(set(ids))
        actors.shutdown()
        rollouts.shutdown()
    finally:
        pools.remove()


def test_split_roles_never_share_a_gpu_and_gloo_spans_nodes(cluster):
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"train": 4, "rollout": 4},
                          [train("actor", "train"), RoleSpec("rollout", "rollout", "rollout", tp=1)])
    pools = create_pools(plan, timeout_s=60)
    try:
        assert {cluster[n] for n in pools.bundle_node_ids("train")} == {0}
        assert {cluster[n] for n in pools.bundle_node_ids("rollout")} == {1}
        actors = WorkerGroup(Probe, plan.roles["actor"], pools)
        rollouts = WorkerGroup(Probe, plan.roles["rollout"], pools)
        a = {(i["node_id"], i["gpu_ids"][0]) for i in actors.call("node_info", timeout_s=60)}
        r = {(i["node_id"], i["gpu_ids"][0]) for i in rollouts.call("node_info", timeout_s=60)}
        assert len(a) == 4 and len(r) == 4 and not a & r
        actors.shutdown()
        rollouts.shutdown()
    finally:
        pools.remove()

    # a gloo group over a worker group whose ranks sit on both nodes
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"p": 4 * NODES}, [train("actor", "p", tp=4)])
    pools = create_pools(plan, timeout_s=60)
    try:
        group = WorkerGroup(Probe, plan.roles["actor"], pools)
        nodes = {cluster[i["node_id"]] for i in group.call("node_info", timeout_s=60)}
        assert nodes == {0, 1}
        group.init_process_group("gloo", timeout_s=60)
        world = len(group)
        assert group.call("all_reduce_rank", timeout_s=60) == [world * (world + 1) / 2] * world
        group.shutdown()
    finally:
        pools.remove()


def test_hung_crashed_and_failing_ranks_are_named(cluster):
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"p": 4}, [train("actor", "p")])
    pools = create_pools(plan, timeout_s=60)
    try:
        group = WorkerGroup(Probe, plan.roles["actor"], pools)
        group.call("node_info", timeout_s=60)  # all up
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"actor.sleep: no answer within 2 s from actor rank 0 on node0, "
                                                   r"actor rank 1 on node0, actor rank 2 on node0, actor rank 3 on node0"):
            group.call_each("sleep", [(30,), (30,), (30,), (30,)], timeout_s=2)
        assert time.monotonic() - t0 < 10
        group.shutdown()

        group = WorkerGroup(Probe, plan.roles["actor"], pools)
        with pytest.raises(WorkerGroupError, match=r"actor rank 2 on node0 raised ValueError: .*bad input on rank 2"):
            group.call("fail_on", 2, timeout_s=60)
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"actor rank 1 on node0 died"):
            group.call("die_on", 1, timeout_s=60)
        assert time.monotonic() - t0 < 30
        group.shutdown()
    finally:
        pools.remove()


def test_plan_larger_than_cluster_is_refused(cluster):
    plan = plan_placement(ClusterSpec(3, GPUS), {"p": 12}, [train("actor", "p")])
    with pytest.raises(PlacementTimeout, match=r"the plan uses 3 nodes .* Ray has 2 alive node\(s\) with GPUs"):
        create_pools(plan, timeout_s=5)
    plan = plan_placement(ClusterSpec(NODES, 8), {"p": 8}, [train("actor", "p")])
    with pytest.raises(PlacementTimeout, match="fewer GPUs than trainer.n_gpus_per_node=8"):
        create_pools(plan, timeout_s=5)
