"""The environment `megarl.config.devices` decides for the training workers reaches the spec Ray
starts every rank's process with: `EngineGroup` -> `WorkerGroup` -> the actor's
`runtime_env={"env_vars": ...}`, which Ray sets in the worker process's environment when it starts
it, before any import (so before torch can initialise CUDA there). Ray itself is replaced by a
recorder of what the actors would be started with."""
import pytest

from megarl.config import load_config
from megarl.config.devices import decide_devices, devices_from_config
from megarl.placement import plan_from_config
from megarl.placement import worker_group
from megarl.placement.gpu_order import BundleGpu
from megarl.placement.ray_pools import RayNode, RealisedPools
from megarl.runtime.engine_group import EngineGroup
from megarl.workers.train_worker import TrainWorker

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m", "trainer.n_gpus_per_node=4",
            "placement.mode=split", "placement.rollout_gpus=2"]


class Spawned(Exception):
    """Raised where the group would form its torch.distributed world: the actors exist by then."""


def spawn_specs(monkeypatch, config, devices) -> list[dict]:
    """Ray's `.options(...)` of each rank of the actor role, as EngineGroup starts them."""
    specs = []

    class Recorded:
        def options(self, **options):
            specs.append(options)
            return self

        def remote(self, *args, **kwargs):
            return object()

    def remote(cls):
        assert cls is TrainWorker
        return Recorded()

    def init_process_group(self, backend, timeout_s=120.0):
        raise Spawned(backend)

    monkeypatch.setattr(worker_group.ray, "remote", remote)
    monkeypatch.setattr(worker_group.WorkerGroup, "init_process_group", init_process_group)
    plan = plan_from_config(config)
    role = plan.roles["actor"]
    devices_of_pool = plan.pools[role.pool].devices
    pools = RealisedPools(groups={role.pool: object()}, nodes=[RayNode("n0", "node0", 4.0)],
                          bundle_gpus={role.pool: [BundleGpu("n0", str(i), i) for i in range(len(devices_of_pool))]},
                          device_bundle={role.pool: list(range(len(devices_of_pool)))})
    with pytest.raises(Spawned) as info:
        EngineGroup(role, pools, config, devices)
    assert str(info.value) == devices.training_backend
    assert len(specs) == role.world_size == 2
    return specs


def test_on_cuda_every_training_rank_starts_with_one_cuda_connection_and_the_nccl_environment(monkeypatch):
    config = load_config(None, REQUIRED + ["trainer.device=cuda"])
    devices = devices_from_config(config, cuda_available=True)
    for spec in spawn_specs(monkeypatch, config, devices):
        env = spec["runtime_env"]["env_vars"]
        assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # megatron-core tensor_parallel/layers.py relies on it
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
        assert env == devices.training_env


def test_on_cpu_no_cuda_variable_reaches_the_workers(monkeypatch):
    config = load_config(None, REQUIRED + ["trainer.device=cpu", "actor_rollout_ref.rollout.name=cpu"])
    devices = decide_devices("cpu", False, "split", "cpu", "auto", collective_timeout_s=600.0)
    for spec in spawn_specs(monkeypatch, config, devices):
        assert spec["runtime_env"] == {"env_vars": {}}
