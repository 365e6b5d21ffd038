"""Plan devices mapped onto the GPUs Ray's bundles really got (shuffled, offset, non-consecutive),
checked against maps written out by hand; SGLang's `--base-gpu-id` + TP rank rule per server."""
import pytest

from megarl.placement import ClusterSpec, RoleSpec, plan_placement
from megarl.placement.gpu_order import (
    BundleGpu,
    GpuOrderError,
    device_bundles,
    real_server_gpus,
    server_gpu_problems,
)
from megarl.sync.colocation import colocated_peers


def colocated_plan(nodes: int, gpus: int, rollout_tp: int):
    return plan_placement(ClusterSpec(nodes, gpus), {"shared": nodes * gpus},
                          [RoleSpec("actor", "shared", "train"), RoleSpec("rollout", "shared", "rollout", tp=rollout_tp)])


def test_shuffled_bundles_are_mapped_by_the_gpu_they_got():
    plan = colocated_plan(2, 4, 2)
    devices = plan.pools["shared"].devices
    nodes = ["A" if d.node == 0 else "B" for d in devices]
    # Ray handed node A's bundles GPUs 2, 0, 3, 1 and node B's 1, 3, 0, 2 (CUDA indexes)
    got = [BundleGpu("A", str(i), i) for i in (2, 0, 3, 1)] + [BundleGpu("B", f"GPU-{i}", i) for i in (1, 3, 0, 2)]
    order = device_bundles("shared", devices, nodes, got)
    # plan device i (node A GPU i, then node B GPU i - 4) -> the bundle holding that node's (i mod 4)-th lowest GPU
    assert order == [1, 3, 0, 2, 6, 4, 7, 5]
    real = [got[b] for b in order]
    assert [(g.node_id, g.index) for g in real] == [("A", 0), ("A", 1), ("A", 2), ("A", 3),
                                                    ("B", 0), ("B", 1), ("B", 2), ("B", 3)]
    rollout = plan.roles["rollout"]
    assert server_gpu_problems(rollout, real) == []
    # with bundle indexes taken for GPUs, server 0 (bundles 0, 1) would run on GPUs 2 and 3 with --base-gpu-id 2,
    # while actor ranks 0 and 1 sit on GPUs 2 and 0: the IPC copy for its TP rank 1 would come from the wrong GPU
    peers = colocated_peers([(g.node_id, g.index) for g in real], real_server_gpus(rollout, real))
    assert peers == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_pool_offset_on_its_node_keeps_plan_order():
    plan = colocated_plan(1, 4, 4)
    devices = plan.pools["shared"].devices
    got = [BundleGpu("A", str(i), i) for i in (7, 5, 4, 6)]  # another job holds GPUs 0-3
    order = device_bundles("shared", devices, ["A"] * 4, got)
    assert order == [2, 1, 3, 0]
    real = [got[b] for b in order]
    assert server_gpu_problems(plan.roles["rollout"], real) == []
    assert real_server_gpus(plan.roles["rollout"], real) == [[("A", 4), ("A", 5), ("A", 6), ("A", 7)]]


def test_a_server_on_gpus_that_are_no_run_is_refused_by_name():
    plan = colocated_plan(1, 4, 2)
    got = [BundleGpu("A", str(i), i) for i in (5, 0, 2, 3)]
    real = [got[b] for b in device_bundles("shared", plan.pools["shared"].devices, ["A"] * 4, got)]
    assert [g.index for g in real] == [0, 2, 3, 5]
    problems = server_gpu_problems(plan.roles["rollout"], real)
    assert len(problems) == 2
    assert problems[0].startswith("rollout server 0 has GPUs with CUDA index [0, 2]")
    assert "--base-gpu-id=0 + rank, i.e. [0, 1]" in problems[0]
    assert problems[1].startswith("rollout server 1 has GPUs with CUDA index [3, 5]")


def test_reports_that_contradict_the_plan_are_refused():
    plan = colocated_plan(1, 2, 1)
    devices = plan.pools["shared"].devices
    with pytest.raises(GpuOrderError, match="bundle 1 is on Ray node B"):
        device_bundles("shared", devices, ["A", "A"], [BundleGpu("A", "0", 0), BundleGpu("B", "0", 0)])
    with pytest.raises(GpuOrderError, match="bundles 0 and 1 both got GPU 3"):
        device_bundles("shared", devices, ["A", "A"], [BundleGpu("A", "3", 3), BundleGpu("A", "3", 3)])
