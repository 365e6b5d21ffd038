"""The device decisions of the Slurm launcher and the cluster check, case by case: what each srun
step asks for, which socket interface variables travel, and which backend the check's all-reduce
uses."""
import pytest

from megarl.launch.check import ClusterCheckError, probe_backend
from megarl.launch.settings import socket_env
from megarl.launch.slurm import srun_step


def test_a_ray_node_step_asks_for_the_nodes_cpus_and_gpus_explicitly():
    step = srun_step(["n2"], cpus_per_task=64, gpus_per_node=8)
    assert step == ("srun", "--overlap", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--nodelist=n2",
                    "--cpus-per-task=64", "--export=ALL", "--gres=gpu:8")


def test_a_step_without_gpus_asks_for_none_and_at_least_one_cpu():
    step = srun_step(["n2", "n3"], cpus_per_task=0, gpus_per_node=0)
    assert "--cpus-per-task=1" in step and not any(a.startswith("--gres") for a in step)
    assert "--nodes=2" in step and "--nodelist=n2,n3" in step


def test_socket_interface_variables_are_picked_from_the_environment():
    env = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0,eth1", "TP_SOCKET_IFNAME": "", "PATH": "/bin",
           "NCCL_DEBUG": "INFO"}
    assert socket_env(env) == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0,eth1"}
    assert socket_env({}) == {}


@pytest.mark.parametrize("cuda_seen, backend", [
    ([True, True, True, True], "nccl"),  # GPU nodes: NCCL on CUDA tensors, the experiment's own path
    ([True], "nccl"),
    ([False, False], "gloo"),  # Ray's logical GPUs on CPU machines
    ([False], "gloo"),
])
def test_the_checks_all_reduce_runs_on_nccl_with_cuda_and_gloo_without(cuda_seen, backend):
    assert probe_backend(cuda_seen) == backend


def test_some_ranks_without_cuda_is_a_broken_node():
    with pytest.raises(ClusterCheckError, match=r"rank\(s\) \[1, 3\] see no CUDA device"):
        probe_backend([True, False, True, False])
