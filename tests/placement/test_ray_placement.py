"""The plan realised on a real Ray cluster of simulated nodes with logical GPUs, and ranks that
hang, fail or die (killed by their PID, stopped, or lost with their node) named from Ray's own
errors."""
import contextlib
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")  # a core dependency: present whenever megarl is installed
from ray.cluster_utils import Cluster  # noqa: E402

from megarl.placement import ClusterSpec, RoleSpec, plan_placement, worker_group  # noqa: E402
from megarl.config.devices import visible_gpu_index  # noqa: E402
from megarl.launch.check import ClusterCheckError, check_cluster  # noqa: E402
from megarl.placement.gpu_order import real_server_gpus, server_gpu_problems  # noqa: E402
from megarl.placement.ray_pools import (  # noqa: E402
    NODE_ID_LABEL,
    NODE_RANK_LABEL,
    PlacementTimeout,
    create_pools,
    probe_bundle_gpus,
)
from megarl.sync.colocation import colocated_peers  # noqa: E402
from megarl.placement.worker_group import WorkerGroup, WorkerGroupError  # noqa: E402
from megarl.workers.base import RankedWorker  # noqa: E402

NODES, GPUS = 2, 4
SHUFFLED_VISIBLE = "3,1,0,2"  # node 1's raylet CUDA_VISIBLE_DEVICES


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"  # same for head, nodes and driver (see ray-and-slurm-on-cpu.md)
    temp = tmp_path_factory.mktemp("ray")
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, num_gpus=0, include_dashboard=False,
                                                          temp_dir=str(temp)))
    # Added in reverse so that plan order (by node-rank label) differs from start order. Node 1's raylet
    # sees its GPUs in a shuffled CUDA_VISIBLE_DEVICES (as a Slurm cgroup or a user may spell it): Ray's GPU
    # ids there are those values, and a process seeing all of them counts them in that order.
    for rank in reversed(range(NODES)):
        c.add_node(num_cpus=2, num_gpus=GPUS, labels={NODE_RANK_LABEL: str(rank)},
                   env_vars={"CUDA_VISIBLE_DEVICES": SHUFFLED_VISIBLE} if rank == 1 else None)
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The plan's node rank of each Ray node id."""
    return {n["NodeID"]: int(n["Labels"][NODE_RANK_LABEL]) for n in ray.nodes() if NODE_RANK_LABEL in n["Labels"]}


def node_ip(node_id: str) -> str:
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


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

    def leave(self) -> None:
        ray.actor.exit_actor()

    def all_reduce_or_sleep(self) -> float:
        """Rank 0 enters an all-reduce; the others sleep (never entering it)."""
        if self.rank == 0:
            return self.all_reduce_rank()
        time.sleep(300)
        return 0.0

    def fail_on_or_all_reduce(self, rank: int) -> float:
        """Rank `rank` raises before the all-reduce the others enter (where they wait for it)."""
        if self.rank == rank:
            raise ValueError(f"rank {rank} fails before the all-reduce")
        return self.all_reduce_rank()


class NeverJoinsOnRank1(Probe):
    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> bool:
        if self.rank == 1:
            time.sleep(300)
        return super().init_process_group(master_addr, master_port, backend, timeout_s)


class FailsToStart(RankedWorker):
    def __init__(self, rank: int, world_size: int, role: str):
        super().__init__(rank, world_size, role)
        raise RuntimeError("no engine here")


class NotAProbe:
    def node_info(self) -> dict:
        return {}


def train(name, pool, tp=1):
    return RoleSpec(name, pool, "train", tp=tp)


def test_colocated_roles_share_gpus_and_bundles_land_on_planned_nodes(cluster):
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"shared": NODES * GPUS},
                          [train("actor", "shared"), RoleSpec("rollout", "shared", "rollout", tp=2)])
    pools = create_pools(plan, timeout_s=300)
    try:
        bundle_nodes = [cluster[n] for n in pools.bundle_node_ids("shared")]
        assert bundle_nodes == [d.node for d in plan.pools["shared"].devices]
        actors = WorkerGroup(Probe, plan.roles["actor"], pools)
        rollouts = WorkerGroup(Probe, plan.roles["rollout"], pools)
        a_info = actors.call(Probe.node_info, timeout_s=300)
        r_info = rollouts.call(Probe.node_info, timeout_s=300)
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


class SeesNodeGpus(Probe):
    """A rank that, like a SGLang server (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1), sees every
    GPU of its node and says the CUDA index of its own."""

    def own_gpu(self) -> tuple[str, str, int]:
        ids = ray.get_gpu_ids()
        return (ray.get_runtime_context().get_node_id(), str(ids[0]),
                visible_gpu_index(ids, os.environ.get("CUDA_VISIBLE_DEVICES")))


def hold_all_but(node_id: str, free: set[int]) -> list:
    """One-GPU placement groups pinned to `node_id` holding every GPU of it but those of CUDA index in
    `free` (as seen with all the node's GPUs visible): GPUs another job holds."""
    from ray.util.placement_group import placement_group, remove_placement_group

    groups = [placement_group([{"GPU": 1}], bundle_label_selector=[{NODE_ID_LABEL: node_id}]) for _ in range(GPUS)]
    for g in groups:
        assert g.wait(60)
    held = []
    for g in groups:
        if probe_bundle_gpus(g, 1, timeout_s=60)[0].index in free:
            remove_placement_group(g)
        else:
            held.append(g)
    assert len(held) == GPUS - len(free)
    return held


def test_ranks_and_servers_go_to_the_gpus_ray_gave_not_to_bundle_indexes(cluster):
    """Another job holds node 0's CUDA GPUs 0 and 2 and node 1's first and last visible GPUs, so the pool gets GPUs
    the plan's indexes do not name: node 0 gives it 1 and 3 (not a run SGLang's --base-gpu-id + rank can
    take), node 1 ids "1" and "0" (CUDA indexes 1 and 2 in its CUDA_VISIBLE_DEVICES "3,1,0,2"). Every rank
    runs on the GPU its bundle reported, the colocated peers follow the real GPUs, and the server whose
    GPUs are no run is refused by name."""
    from ray.util.placement_group import remove_placement_group

    node_of_rank = {rank: node for node, rank in cluster.items()}
    held = hold_all_but(node_of_rank[0], {1, 3}) + hold_all_but(node_of_rank[1], {1, 2})
    try:  # the GPUs held are given back whatever fails: the module's later tests need them
        plan = plan_placement(ClusterSpec(NODES, 2), {"shared": NODES * 2},
                              [train("actor", "shared"), RoleSpec("rollout", "shared", "rollout", tp=2)])
        pools = create_pools(plan, timeout_s=300)
        try:
            real = [pools.device_gpu("shared", i) for i in range(4)]
            assert [(cluster[g.node_id], g.gpu_id, g.index) for g in real] == [
                (0, "1", 1), (0, "3", 3), (1, "1", 1), (1, "0", 2)]
            actors = WorkerGroup(SeesNodeGpus, plan.roles["actor"], pools,
                                 env={"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
            seen = actors.call(SeesNodeGpus.own_gpu, timeout_s=300)
            actors.shutdown()
            assert seen == [(g.node_id, g.gpu_id, g.index) for g in real]
            rollout = plan.roles["rollout"]
            server_gpus = real_server_gpus(rollout, real)
            assert [[(cluster[n], i) for n, i in row] for row in server_gpus] == [[(0, 1), (0, 2)], [(1, 1), (1, 2)]]
            problems = server_gpu_problems(rollout, real)
            assert len(problems) == 1 and problems[0].startswith("rollout server 0 has GPUs with CUDA index [1, 3]")
            # server 1 (node 1) is a run: its TP ranks are on the GPUs of actor ranks 2 and 3
            assert colocated_peers([(g.node_id, g.index) for g in real], server_gpus[1:]) == [[2, 3]]
        finally:
            pools.remove()
        # `megarl check-cluster` shows planned beside real GPUs and names the server that cannot start
        plan = plan_placement(ClusterSpec(NODES, GPUS), {"shared": 2},
                              [train("actor", "shared"), RoleSpec("rollout", "shared", "rollout", tp=2)])
        lines = []
        with pytest.raises(ClusterCheckError, match=r"rollout server 0 has GPUs with CUDA index \[1, 3\]"):
            check_cluster(plan, timeout_s=120, log=lines.append)
        assert lines[0].split() == ["pool", "rank", "plan", "node", "plan", "GPU", "Ray", "node", "Slurm", "node",
                                    "GPU", "index", "CUDA_VISIBLE_DEVICES"]
        assert [(line.split()[4], line.split()[8]) for line in lines[1:3]] == [("0", "1"), ("1", "3")]
    finally:
        for g in held:
            remove_placement_group(g)


def test_split_roles_never_share_a_gpu_and_gloo_spans_nodes(cluster):
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"train": 4, "rollout": 4},
                          [train("actor", "train"), RoleSpec("rollout", "rollout", "rollout", tp=1)])
    pools = create_pools(plan, timeout_s=300)
    try:
        assert {cluster[n] for n in pools.bundle_node_ids("train")} == {0}
        assert {cluster[n] for n in pools.bundle_node_ids("rollout")} == {1}
        actors = WorkerGroup(Probe, plan.roles["actor"], pools)
        rollouts = WorkerGroup(Probe, plan.roles["rollout"], pools)
        a = {(i["node_id"], i["gpu_ids"][0]) for i in actors.call(Probe.node_info, timeout_s=300)}
        r = {(i["node_id"], i["gpu_ids"][0]) for i in rollouts.call(Probe.node_info, timeout_s=300)}
        assert len(a) == 4 and len(r) == 4 and not a & r
        actors.shutdown()
        rollouts.shutdown()
    finally:
        pools.remove()

    # a gloo group over a worker group whose ranks sit on both nodes
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"p": 4 * NODES}, [train("actor", "p", tp=4)])
    pools = create_pools(plan, timeout_s=300)
    try:
        group = WorkerGroup(Probe, plan.roles["actor"], pools)
        nodes = {cluster[i["node_id"]] for i in group.call(Probe.node_info, timeout_s=300)}
        assert nodes == {0, 1}
        group.init_process_group("gloo", timeout_s=300)
        world = len(group)
        assert group.call(Probe.all_reduce_rank, timeout_s=300) == [world * (world + 1) / 2] * world
        group.shutdown()
    finally:
        pools.remove()


def test_hung_crashed_and_failing_ranks_are_named(cluster):
    plan = plan_placement(ClusterSpec(NODES, GPUS), {"p": 4}, [train("actor", "p")])
    pools = create_pools(plan, timeout_s=300)
    try:
        group = WorkerGroup(Probe, plan.roles["actor"], pools)
        group.call(Probe.node_info, timeout_s=300)  # all up
        # a method of another class, even of the same name, is not the workers' (nothing is sent)
        with pytest.raises(TypeError, match=r"actor: <function NotAProbe.node_info .*> is not a method of its "
                                            r"workers' class Probe"):
            group.call(NotAProbe.node_info, timeout_s=300)
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"actor.sleep: no answer within 2 s from actor rank 0 on node0, "
                                                   r"actor rank 1 on node0, actor rank 2 on node0, actor rank 3 on node0"):
            group.call_each(Probe.sleep, [(30,), (30,), (30,), (30,)], timeout_s=2)
        assert time.monotonic() - t0 < 10
        group.shutdown()

        group = WorkerGroup(Probe, plan.roles["actor"], pools)
        with pytest.raises(WorkerGroupError, match=r"actor rank 2 on node0 raised ValueError: .*bad input on rank 2"):
            group.call(Probe.fail_on, 2, timeout_s=300)
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"actor rank 1 on node0 died"):
            group.call(Probe.die_on, 1, timeout_s=300)
        assert time.monotonic() - t0 < 30
        group.shutdown()
    finally:
        pools.remove()


def test_rank_0_hosts_the_store_before_anyone_joins_and_a_rank_that_never_joins_is_named(cluster, monkeypatch):
    import datetime

    import torch.distributed as dist

    monkeypatch.setattr(worker_group, "JOIN_GRACE_S", 5.0)
    with actor_pool(2) as (role, pools):
        group = WorkerGroup(NeverJoinsOnRank1, role, pools)
        addr, port = group.call_ranks([0], Probe.master_address, 30.0, timeout_s=300)[0]
        client = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=5))
        client.set("seen", "yes")  # listening already: nothing can take the port before the ranks join
        assert client.get("seen") == b"yes"
        with pytest.raises(WorkerGroupError, match=r"actor rank 1 on node0 raised RuntimeError: actor rank 1: "
                                                   r"only rank 0 hosts the process group's store"):
            group.call_ranks([1], Probe.master_address, 30.0, timeout_s=300)

        # rank 0 gives up after its 3 s with the store's own error, the first failure; rank 1, still
        # inside the call when the group's time is up, is named and stopped with its group
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError) as error:
            group.init_process_group("gloo", timeout_s=3)
        assert time.monotonic() - t0 < 30
        lines = str(error.value).splitlines()
        assert lines[0] == "actor.init_process_group failed:"
        assert lines[1].startswith("  - actor rank 0 on node0 raised DistStoreError: "), lines[1]
        assert lines[-1] == ("  - actor rank 1 on node0 was still inside the call 10 s after actor rank 0 on node0 "
                             "failed: stopped (presumably blocked in a collective with it)")
        group.shutdown()


def test_a_rank_that_raises_before_a_collective_ends_the_call_on_every_rank_in_seconds(cluster, monkeypatch):
    """Rank 1 raises while rank 0 waits for it in an all-reduce (whose own timeout is 300 s): the call
    ends within the failure grace, rank 1's error first, and rank 0, stuck, is stopped by its group."""
    monkeypatch.setattr(worker_group, "FAILURE_GRACE_S", 3.0)
    with actor_pool(2) as (role, pools):
        group = WorkerGroup(Probe, role, pools)
        pids = [info["pid"] for info in group.call(Probe.node_info, timeout_s=300)]
        group.init_process_group("gloo", timeout_s=300)
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError) as error:
            group.call(Probe.fail_on_or_all_reduce, 1, timeout_s=300)
        assert time.monotonic() - t0 < 15  # the grace (3 s) and Ray's answer, not the all-reduce's 300 s
        lines = str(error.value).splitlines()
        assert lines[0] == "actor.fail_on_or_all_reduce failed:"
        assert lines[1] == "  - actor rank 1 on node0 raised ValueError: rank 1 fails before the all-reduce"
        assert lines[-1] == ("  - actor rank 0 on node0 was still inside the call 3 s after actor rank 1 on node0 "
                             "failed: stopped (presumably blocked in a collective with it)")
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in pids):  # both workers' processes end (ray.kill), not at the 300 s
            assert time.monotonic() < deadline, [pid for pid in pids if alive(pid)]
            time.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"^actor.node_info: actor's workers were stopped after an "
                                                   r"earlier failure \(actor.fail_on_or_all_reduce: actor rank 1"):
            group.call(Probe.node_info, timeout_s=300)
        assert time.monotonic() - t0 < 10  # refused at once, not after the 300 s
        group.shutdown()


def test_a_rank_that_never_enters_a_collective_fails_its_peer_at_the_group_timeout(cluster, monkeypatch):
    """Rank 1 stays busy elsewhere while rank 0 waits for it in an all-reduce: rank 0's collective
    fails at the world's timeout (3 s here; actor_rollout_ref.nccl_timeout in a run), which ends
    the call: rank 1, still inside it after the grace, is stopped with its group."""
    monkeypatch.setattr(worker_group, "FAILURE_GRACE_S", 3.0)
    with actor_pool(2) as (role, pools):
        group = WorkerGroup(Probe, role, pools)
        group.call(Probe.node_info, timeout_s=300)  # both up first: on a loaded machine an actor may take > 3 s to start
        group.init_process_group("gloo", timeout_s=3)  # a Probe's world: collectives bounded by the join's 3 s
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError) as error:
            group.call_each(Probe.all_reduce_or_sleep, [(), ()], timeout_s=300)
        assert time.monotonic() - t0 < 20  # 3 s timeout + 3 s grace + Ray, not the call's 300 s
        lines = str(error.value).splitlines()
        assert lines[1].startswith("  - actor rank 0 on node0 raised "), lines[1]
        assert "3000ms" in lines[1]  # gloo's own words on its timeout
        assert lines[-1] == ("  - actor rank 1 on node0 was still inside the call 3 s after actor rank 0 on node0 "
                             "failed: stopped (presumably blocked in a collective with it)")
        group.shutdown()


def test_a_rank_that_raises_alone_leaves_its_group_working(cluster, monkeypatch):
    """A failure no peer waits on (they all answered): nothing is stopped, the next call works."""
    with actor_pool(2) as (role, pools):
        group = WorkerGroup(Probe, role, pools)
        group.init_process_group("gloo", timeout_s=300)
        with pytest.raises(WorkerGroupError, match=r"actor rank 0 on node0 raised ValueError: .*bad input on rank 0"):
            group.call(Probe.fail_on, 0, timeout_s=300)
        assert group.call(Probe.all_reduce_rank, timeout_s=300) == [3.0, 3.0]
        group.shutdown()


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_plan_larger_than_cluster_is_refused(cluster):
    plan = plan_placement(ClusterSpec(3, GPUS), {"p": 12}, [train("actor", "p")])
    with pytest.raises(PlacementTimeout, match=r"the plan uses 3 nodes .* Ray has 2 alive node\(s\) with GPUs"):
        create_pools(plan, timeout_s=5)
    plan = plan_placement(ClusterSpec(NODES, 8), {"p": 8}, [train("actor", "p")])
    with pytest.raises(PlacementTimeout, match="fewer GPUs than trainer.n_gpus_per_node=8"):
        create_pools(plan, timeout_s=5)


@contextlib.contextmanager
def actor_pool(ranks: int, spec: ClusterSpec = ClusterSpec(NODES, GPUS)):
    """(role, pools) of one training role of `ranks` ranks, realised; the placement groups go after."""
    plan = plan_placement(spec, {"p": ranks}, [train("actor", "p")])
    pools = create_pools(plan, timeout_s=300)
    try:
        yield plan.roles["actor"], pools
    finally:
        pools.remove()


def error_when_during(event, call, *args, **kwargs) -> str:
    """The `WorkerGroupError` message of `call(*args, **kwargs)` when `event()` happens 1 s into it."""
    timer = threading.Timer(1.0, event)
    timer.start()
    try:
        with pytest.raises(WorkerGroupError) as error:
            call(*args, **kwargs)
    finally:
        timer.join(timeout=300)
    return str(error.value)


def test_a_rank_killed_by_its_pid_is_named_from_rays_error(cluster):
    with actor_pool(2) as (role, pools):
        group = WorkerGroup(Probe, role, pools)
        victim = group.call(Probe.node_info, timeout_s=300)[1]
        # rank 1 is killed during the call; rank 0 answers within the grace a death gives its peers
        message = error_when_during(lambda: os.kill(victim["pid"], signal.SIGKILL), group.call, Probe.sleep, 5,
                                    timeout_s=300)
        assert message.startswith(
            f"actor.sleep failed:\n  - actor rank 1 on node0 died: the worker process (pid {victim['pid']}, node "
            f"{node_ip(victim['node_id'])}) exited unexpectedly (SIGKILL, the OOM killer or a crash?); "
            "Ray: SYSTEM_ERROR: ")
        assert "rank 0" not in message
        with pytest.raises(ray.exceptions.ActorDiedError):  # the error Ray gives for that rank
            ray.get(group.actors[1].node_info.remote(), timeout=30)
        group.shutdown()


def test_ranks_stopped_on_purpose_or_failing_to_start_are_named_from_rays_errors(cluster):
    with actor_pool(2) as (role, pools):
        group = WorkerGroup(Probe, role, pools)
        infos = group.call(Probe.node_info, timeout_s=300)
        where = [f"(pid {i['pid']}, node {node_ip(i['node_id'])})" for i in infos]
        with pytest.raises(WorkerGroupError) as error:
            group.call_ranks([0], Probe.leave, timeout_s=300)
        assert str(error.value).startswith(
            f"actor.leave failed:\n  - actor rank 0 on node0 died: the worker process {where[0]} was stopped on "
            "purpose (ray.kill or exit_actor); Ray: INTENDED_USER_EXIT: ")
        # Ray 2.60 gives no exit type for ray.kill: the first line of its message is quoted
        message = error_when_during(lambda: ray.kill(group.actors[1]), group.call_ranks, [1], Probe.sleep, 30,
                                    timeout_s=300)
        assert message == (f"actor.sleep failed:\n  - actor rank 1 on node0 died: the worker process {where[1]} is "
                           "gone: The actor died unexpectedly before finishing this task.")
        group.shutdown()

        group = WorkerGroup(FailsToStart, role, pools)
        with pytest.raises(WorkerGroupError, match=r"actor rank 0 on node0 died: the worker process failed while "
                                                   r"starting: The actor died because of an error raised in its "
                                                   r"creation task"):
            group.call(FailsToStart.node_info, timeout_s=300)
        group.shutdown()


def test_a_rank_lost_with_its_node_is_named(ray_cluster, cluster):
    """Last in the module: it leaves the cluster with a dead node."""
    doomed = ray_cluster.add_node(num_cpus=2, num_gpus=1, labels={NODE_RANK_LABEL: str(NODES)})
    ray_cluster.wait_for_nodes(timeout=300)
    with actor_pool(NODES + 1, ClusterSpec(NODES + 1, 1)) as (role, pools):  # rank r on node r
        group = WorkerGroup(Probe, role, pools)
        lost = group.call(Probe.node_info, timeout_s=300)[NODES]
        where = f"(pid {lost['pid']}, node {node_ip(lost['node_id'])})"
        message = error_when_during(lambda: ray_cluster.remove_node(doomed), group.call, Probe.sleep, 5, timeout_s=300)
        # Ray 2.60 says "The actor died because its node has died", with no exit type
        assert message.startswith(f"actor.sleep failed:\n  - actor rank {NODES} on node{NODES} died: the worker "
                                  f"process {where} ")
        group.shutdown()
