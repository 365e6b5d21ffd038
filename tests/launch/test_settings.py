"""The pieces of a launch that need no cluster: options, ports, `ray start` command lines, the
allocation check, the per-node GPU split, and the node check over what `ray.nodes()` returns."""
from pathlib import Path

import pytest

from megarl.config import ConfigError
from megarl.launch.check import node_problems
from megarl.launch.local import gpu_ids_per_node
from megarl.launch.ray_nodes import ray_start_command
from megarl.launch.settings import (
    LaunchOptions,
    NodeLaunch,
    RaySettings,
    ports_for_job,
)
from megarl.launch.slurm import SlurmJob, allocation_problems
from megarl.placement import ClusterSpec, RoleSpec, plan_placement


def test_options_from_the_environment():
    opts = LaunchOptions.from_env({"MEGARL_ENTRY": "-m megarl.trainer.main_ppo --dry-run", "MEGARL_JOIN_TIMEOUT": "15",
                                   "MEGARL_RAY_WRAPPER": "apptainer exec --nv img.sif", "MEGARL_TMPDIR": "/scratch"})
    assert opts.experiment_command(["--config", "x.yaml"])[1:] == ["-m", "megarl.trainer.main_ppo", "--dry-run",
                                                                   "--config", "x.yaml"]
    assert (opts.join_timeout_s, opts.tmp_base, opts.ray_wrapper) == (15.0, Path("/scratch"),
                                                                      ("apptainer", "exec", "--nv", "img.sif"))
    assert LaunchOptions.from_env({}).entry == ("-m", "megarl.trainer.main_ppo")


def test_job_ports_avoid_rays_worker_ports_and_taken_ports():
    assert ports_for_job(4001, is_free=lambda p: True) == (20002, 20003)
    taken = {20002}
    assert ports_for_job(4001, is_free=lambda p: p not in taken) == (20004, 20005)
    for job in (0, 3999, 123456789):
        assert 20000 <= ports_for_job(job, is_free=lambda p: True)[0] < 28000


def test_ray_start_commands_label_nodes_and_pass_gpus_explicitly():
    settings = RaySettings(head_ip="10.0.0.1", port=20010, client_port=20011, temp_dir=Path("/tmp/megarl-5"),
                           gpus_per_node=8, cpus_per_node=64, wrapper=("wrap",),
                           extra_args=("--object-store-memory=1",))
    head = ray_start_command(NodeLaunch(0, "gpu001", prefix=("srun", "-w", "gpu001"), labels={"slurm-node": "gpu001"}),
                             settings)
    worker = ray_start_command(NodeLaunch(1, "gpu002", labels={"slurm-node": "gpu002"}), settings)
    assert head[:4] == ["srun", "-w", "gpu001", "wrap"] and head[-1] == "--object-store-memory=1"
    for cmd in (head, worker):
        assert "--block" in cmd and "--num-gpus=8" in cmd and "--num-cpus=64" in cmd
    assert "--labels=megarl-node-rank=0,slurm-node=gpu001" in head
    assert "--labels=megarl-node-rank=1,slurm-node=gpu002" in worker
    assert {"--head", "--port=20010", "--node-ip-address=10.0.0.1", "--ray-client-server-port=20011"} <= set(head)
    assert "--address=10.0.0.1:20010" in worker and "--head" not in worker


def test_allocation_must_match_the_config():
    job = SlurmJob(7, ("n1", "n2"), gpus_per_node=4, cpus_per_node=16)
    assert allocation_problems(job, 2, 4) == []
    problems = allocation_problems(job, 3, 8)
    assert "the job has 2 node(s) (n1,n2) but trainer.nnodes=3: submit with --nodes=3" in problems[0]
    assert "the job has 4 GPU(s) per node but trainer.n_gpus_per_node=8" in problems[1]
    with pytest.raises(ConfigError, match="not inside a Slurm job"):
        SlurmJob.from_env({})


def test_simulated_local_nodes_get_disjoint_gpus():
    assert gpu_ids_per_node(2, 2, None) == [["0", "1"], ["2", "3"]]
    assert gpu_ids_per_node(2, 1, "4,6,7") == [["4"], ["6"]]
    with pytest.raises(ConfigError, match="lists 3 GPU"):
        gpu_ids_per_node(2, 2, "0,1,2")


def ray_node(rank, gpus, name=None, alive=True):
    labels = {"megarl-node-rank": str(rank)} | ({"slurm-node": name} if name else {})
    return {"NodeID": f"{rank:02d}" * 14, "Alive": alive, "Labels": labels, "Resources": {"GPU": gpus}}


def test_node_check_names_missing_mislabelled_and_gpu_less_nodes():
    plan = plan_placement(ClusterSpec(3, 2, ("n1", "n2", "n3")), {"shared": 6}, [RoleSpec("actor", "shared", "train")])
    good = [ray_node(0, 2, "n1"), ray_node(1, 2, "n2"), ray_node(2, 2, "n3")]
    assert node_problems(plan, good) == []
    problems = node_problems(plan, [ray_node(0, 2, "n1"), ray_node(1, 0, "n2"), ray_node(2, 2, "n3", alive=False)])
    assert any("node n2 has 0 GPU(s) in Ray but trainer.n_gpus_per_node=2" in p and "--num-gpus" in p
               for p in problems)
    assert any(p.startswith("plan node 2 (n3) has not joined the Ray cluster") for p in problems)
    swapped = node_problems(plan, [ray_node(0, 2, "n1"), ray_node(1, 2, "n3"), ray_node(2, 2, "n2")])
    assert "plan node 1 should be n2, but the Ray node with megarl-node-rank=1 is labelled slurm-node=n3" in swapped
    unlabelled = [{"NodeID": "ab" * 14, "Alive": True, "Labels": {}, "Resources": {"GPU": 2}}]
    assert node_problems(plan, unlabelled) == ["Ray has 1 node(s) with GPUs; the plan needs trainer.nnodes=3"]
