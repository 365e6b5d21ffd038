"""The device decision (megarl.config.devices), every case on CPU, each against the rule it follows:
PyTorch's backend support table (gloo cannot send/recv/barrier CUDA tensors), NCCL's one rank per
GPU in a communicator ("Duplicate GPU detected"), CUDA IPC only on the same GPUs, SGLang's NCCL
environment. Where a rule can be checked by something other than the function, it is: torch's own
reading of the backend string, and the real planner's GPU map."""
from pathlib import Path

import pytest
from torch.distributed.distributed_c10d import Backend, BackendConfig

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.devices import GPU_ENV_VARS, Devices, decide_devices, devices_from_config, visible_gpu_index
from megarl.placement import plan_from_config
from megarl.sync.colocation import colocated_peers

KEY = "actor_rollout_ref.rollout.weight_sync_transport"
REPO = Path(__file__).resolve().parents[2]
REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]

# PyTorch distributed docs, "Backends" table: with CUDA tensors, gloo has no send, recv or barrier.
GLOO_CUDA_UNSUPPORTED = {"send", "recv", "barrier"}
MEGATRON_PP_NEEDS = {"send", "recv"}  # megatron's pipeline schedules are P2P

TIMEOUT_S = 1800.0  # actor_rollout_ref.nccl_timeout's default
# on CUDA every training worker gets NCCL's watchdog (PyTorch's ProcessGroupNCCL environment variables page):
# abort + tear down on error, the monitor on, a heartbeat no shorter than the 1800 s collective timeout
WATCHDOG_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1800"}
# and one CUDA work queue, which megatron-core's overlapped collectives are written for
# (tensor_parallel/layers.py: "Here we rely on CUDA_DEVICE_MAX_CONNECTIONS=1"): tests/config/test_cuda_env.py
CUDA_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
CUDA_TRAINING_ENV = {**CUDA_ENV, **WATCHDOG_ENV}


def device_backends(backend: str) -> dict[str, str]:
    """Which backend torch itself uses for each device type under `backend`."""
    return BackendConfig(Backend(backend)).get_device_backend_map()


# ------------------------------------------------------------------------------------- on CPU
@pytest.mark.parametrize("device,cuda_available", [("cpu", False), ("auto", False), ("cpu", True)])
def test_cpu_runs_gloo_everywhere_and_keeps_the_distributed_transport(device, cuda_available):
    d = decide_devices(device, cuda_available, "colocate", "cpu", "auto", collective_timeout_s=TIMEOUT_S)
    assert d == Devices("cpu", "gloo", "distributed", "gloo", ())
    assert d.training_env == {}
    assert set(device_backends(d.training_backend).values()) == {"gloo"}


def test_cpu_split_and_disk_keep_their_transport():
    split = decide_devices("cpu", False, "split", "cpu", "auto", collective_timeout_s=TIMEOUT_S)
    assert split.weight_sync_transport == "distributed"
    disk = decide_devices("cpu", False, "colocate", "cpu", "disk", collective_timeout_s=TIMEOUT_S)
    assert disk == Devices("cpu", "gloo", "disk", None, ())


# ------------------------------------------------------------------------------------- on CUDA
@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_cuda_training_groups_send_cuda_tensors_over_nccl_and_cpu_objects_over_gloo(device):
    d = decide_devices(device, True, "colocate", "sglang", "auto", collective_timeout_s=TIMEOUT_S)
    assert d.device == "cuda"
    by_device = device_backends(d.training_backend)
    # megatron's PP sends CUDA tensors, which gloo cannot; CPU objects (gather_object) stay on gloo
    assert MEGATRON_PP_NEEDS & GLOO_CUDA_UNSUPPORTED  # so CUDA tensors must not go over gloo
    assert by_device == {"cpu": "gloo", "cuda": "nccl"}


@pytest.mark.parametrize("gpus,rollout_tp", [(1, 1), (2, 1), (8, 2), (8, 4)])
def test_cuda_colocated_auto_sends_ipc_handles_made_on_each_server_gpu(gpus, rollout_tp):
    """A CUDA IPC handle opens only on its own GPU and SGLang's TP rank r opens entry r
    (tp_worker.py::deserialize_own_rank): every server GPU needs exactly one actor rank on it to
    serialise entry r. Oracle: the real planner's GPU map of the colocated config."""
    config = load_config(None, REQUIRED + [f"trainer.n_gpus_per_node={gpus}",
                                           f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}"])
    plan = plan_from_config(config)
    rollout = plan.roles["rollout"]
    peers = colocated_peers(plan.roles["actor"].devices, [rollout.server_devices(s) for s in range(rollout.dp)])
    assert sorted(k for row in peers for k in row) == list(range(gpus))  # every GPU: one server rank, one actor rank
    d = devices_from_config(config, True)
    assert (d.weight_sync_transport, d.weight_sync_backend, d.training_env) == ("tensor", None, CUDA_TRAINING_ENV)


def test_cpu_colocated_tensor_shares_memory_on_one_machine():
    d = decide_devices("cpu", False, "colocate", "cpu", "tensor", collective_timeout_s=TIMEOUT_S)
    assert d == Devices("cpu", "gloo", "tensor", None)


def test_cuda_split_auto_broadcasts_over_nccl_with_sglangs_nccl_environment():
    d = decide_devices("auto", True, "split", "sglang", "auto", collective_timeout_s=TIMEOUT_S)
    assert (d.weight_sync_transport, d.weight_sync_backend) == ("distributed", "nccl")
    # sglang entrypoints/engine.py::_set_envs_and_config: what the servers' side of the group runs with
    assert d.training_env == {**CUDA_ENV, "NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0", **WATCHDOG_ENV}


def test_cuda_disk_needs_no_group_and_no_weight_group_nccl_environment():
    d = decide_devices("cuda", True, "colocate", "sglang", "disk", collective_timeout_s=TIMEOUT_S)
    assert (d.weight_sync_transport, d.weight_sync_backend, d.training_env) == ("disk", None, CUDA_TRAINING_ENV)


def test_cuda_with_the_cpu_engine_broadcasts_over_gloo():
    # the CPU engine's tensors live on the CPU and it has no tensor endpoint; gloo broadcasts CUDA
    # tensors too (the support table), so no NCCL weight group and none of SGLang's NCCL environment
    d = decide_devices("cuda", True, "colocate", "cpu", "auto", collective_timeout_s=TIMEOUT_S)
    assert (d.weight_sync_transport, d.weight_sync_backend) == ("distributed", "gloo")
    assert d.training_env == CUDA_TRAINING_ENV
    assert "broadcast" not in GLOO_CUDA_UNSUPPORTED


# ------------------------------------------------------------------------------------- refusals
def test_cuda_requested_without_cuda_names_trainer_device():
    with pytest.raises(ConfigError, match=r"trainer\.device=cuda, but this machine has no CUDA GPU"):
        decide_devices("cuda", False, "colocate", "sglang", "auto", collective_timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("mode,refused", [("colocate", True), ("split", False)])
def test_distributed_on_gpus_is_refused_exactly_where_the_plan_puts_two_group_ranks_on_one_gpu(mode, refused):
    """Oracle: the planner's GPU map. The stage-0 weight-update group holds the emitter (actor rank 0)
    and every rollout server's TP ranks; NCCL refuses it when two of them share a GPU."""
    config = load_config(None, REQUIRED + [f"placement.mode={mode}", "placement.rollout_gpus=4"])
    plan = plan_from_config(config)
    shares_a_gpu = plan.roles["actor"].devices[0] in plan.roles["rollout"].devices
    assert shares_a_gpu == refused
    if refused:
        with pytest.raises(ConfigError) as info:
            decide_devices("cuda", True, mode, "sglang", "distributed", collective_timeout_s=TIMEOUT_S)
        assert f"{KEY}=distributed" in str(info.value) and "placement.mode=colocate" in str(info.value)
        assert "Duplicate GPU detected" in str(info.value)
    else:
        d = decide_devices("cuda", True, mode, "sglang", "distributed", collective_timeout_s=TIMEOUT_S)
        assert d.weight_sync_backend == "nccl"


def test_auto_device_names_what_it_resolved_to():
    with pytest.raises(ConfigError, match=r"trainer\.device=auto \(resolved to cuda\)"):
        decide_devices("auto", True, "colocate", "sglang", "distributed", collective_timeout_s=TIMEOUT_S)
    # the same keys on a machine without CUDA run the CPU path
    d = decide_devices("auto", False, "colocate", "cpu", "distributed", collective_timeout_s=TIMEOUT_S)
    assert d.weight_sync_backend == "gloo"


@pytest.mark.parametrize("device,cuda,mode,engine,nodes,says", [
    ("cuda", True, "split", "sglang", 1, "needs placement.mode=colocate, not split"),  # IPC: same GPUs only
    ("cpu", False, "split", "cpu", 1, "needs placement.mode=colocate, not split"),  # shared memory: same processes' machine
    ("cuda", True, "colocate", "cpu", 1, "needs actor_rollout_ref.rollout.name=sglang"),  # CPU tensors only
    ("auto", False, "colocate", "cpu", 2, "trainer.nnodes=2"),  # one machine's shared memory
])
def test_the_tensor_transport_is_refused_where_its_handles_cannot_be_opened(device, cuda, mode, engine, nodes, says):
    with pytest.raises(ConfigError) as info:
        decide_devices(device, cuda, mode, engine, "tensor", nnodes=nodes, collective_timeout_s=TIMEOUT_S)
    assert str(info.value).startswith(f"{KEY}=tensor") and says in str(info.value)


def test_the_tensor_transport_runs_colocated_on_several_gpus_and_nodes():
    # each server TP rank's copy is made by the actor rank on its GPU (sync/ipc_copies.py), on every node
    d = decide_devices("cuda", True, "colocate", "sglang", "tensor", nnodes=2, collective_timeout_s=TIMEOUT_S)
    assert (d.weight_sync_transport, d.weight_sync_backend) == ("tensor", None)


def test_devices_from_config_reads_the_five_keys():
    config = load_config(None, REQUIRED + ["placement.mode=split", "placement.rollout_gpus=4",
                                           "trainer.device=cuda", "actor_rollout_ref.nccl_timeout=7200"])
    d = devices_from_config(config, True)
    assert d == decide_devices("cuda", True, "split", "sglang", "auto", collective_timeout_s=7200.0)
    assert d.training_env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "7200"


# ------------------------------------------------------------------------------------- config time
def test_the_schema_default_transport_is_auto_and_every_shipped_cpu_config_keeps_distributed():
    assert load_config(None, REQUIRED).actor_rollout_ref.rollout.weight_sync_transport == "auto"
    config = load_and_validate(REPO / "configs" / "quickstart.yaml")
    assert devices_from_config(config, False).weight_sync_transport == "distributed"


def test_config_time_rule_refuses_colocated_distributed_on_explicit_cuda_naming_both_keys():
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + [f"{KEY}=distributed", "trainer.device=cuda"])
    message = str(info.value)
    assert f"{KEY}=distributed cannot run with placement.mode=colocate on GPUs (trainer.device=cuda)" in message
    # with trainer.device=auto the config may still run on CPU: the trainer decides when it starts
    load_and_validate(None, REQUIRED + [f"{KEY}=distributed", "trainer.device=auto"])
    load_and_validate(None, REQUIRED + [f"{KEY}=distributed", "trainer.device=cuda", "placement.mode=split",
                                        "placement.rollout_gpus=4"])


def test_config_time_rule_refuses_tensor_where_neither_device_can_run_it():
    with pytest.raises(ConfigError, match="needs placement.mode=colocate, not split"):
        load_and_validate(None, REQUIRED + [f"{KEY}=tensor", "placement.mode=split", "placement.rollout_gpus=4"])
    load_and_validate(None, REQUIRED + [f"{KEY}=tensor", "trainer.device=cuda"])  # colocated on one node of 8
    load_and_validate(None, REQUIRED + [f"{KEY}=tensor", "trainer.device=cpu", "actor_rollout_ref.rollout.name=cpu"])
    load_and_validate(None, REQUIRED + [f"{KEY}=tensor"])  # auto: a CPU machine runs it (shared memory)


# ------------------------------------------------------------------------------------- local GPU
@pytest.mark.parametrize("ray_ids, visible, index", [
    ([3], "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to the actor's GPU: CUDA calls it 0
    (["5"], "4,5,6,7", 1),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 under a raylet seeing 4-7
    (["0"], None, 0),  # the raylet had no CUDA_VISIBLE_DEVICES: ids are physical indexes
    (["5"], "", 5),  # empty string: treated as unset
    ([2], None, 2),  # ints too
    (["6"], "4, 5, 6, 7", 2),
    (["1", "2"], "2,1", 1),  # the first id of the actor's counts, wherever it is in the list
    (["GPU-bbbb"], "GPU-aaaa,GPU-bbbb", 1),  # UUIDs
])
def test_visible_gpu_index_is_the_position_of_rays_gpu_among_the_visible_devices(ray_ids, visible, index):
    assert visible_gpu_index(ray_ids, visible) == index


@pytest.mark.parametrize("ray_ids, visible, says", [
    ([], "0,1", "holds no GPU from Ray"),
    ([2], "0,1", "Ray GPU id '2' is not in this process's CUDA_VISIBLE_DEVICES='0,1'"),
    (["GPU-aaaa"], None, "not an index"),
])
def test_visible_gpu_index_refuses_what_it_cannot_map(ray_ids, visible, says):
    with pytest.raises(ValueError, match=says):
        visible_gpu_index(ray_ids, visible)


# ------------------------------------------------------------------------------------- at run start
def test_the_trainer_applies_the_decision_to_the_machine_it_starts_on(monkeypatch):
    """With trainer.device=auto the config passes validation; the trainer's preflight, run before any
    process starts, refuses it where torch sees CUDA and runs it on gloo where it does not."""
    import torch

    from megarl.runtime.devices import resolve_devices
    from megarl.trainer.preflight import check_environment

    config = load_and_validate(None, REQUIRED + [f"{KEY}=distributed"])
    for name in GPU_ENV_VARS + ("RAY_ADDRESS",):  # a CPU machine's environment (auto would be refused
        monkeypatch.delenv(name, raising=False)  # where the job shows GPUs: tests/config/test_auto_device.py)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_devices(config).weight_sync_backend == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as info:
        check_environment(config)
    assert f"{KEY}=distributed cannot run with placement.mode=colocate on GPUs (trainer.device=auto " \
           "(resolved to cuda))" in str(info.value)


@pytest.mark.parametrize("field", ["optimizer_cpu_offload", "use_precision_aware_optimizer"])
def test_cuda_only_optimizer_options_are_refused_on_a_cpu_where_megatron_core_fails(field):
    """megatron-core itself fails on a CPU with each (the oracle, run here): the precision-aware
    optimizer asks transformer-engine's version (TypeError without it; 0.19: a RuntimeError asking for its
    FusedAdam), the CPU offload's HybridDeviceOptimizer takes CUDA streams (0.19: finds no NVIDIA driver).
    megarl refuses them naming the key, before any
    process starts: at config time with trainer.device=cpu, when the device resolves under auto."""
    import torch
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    with pytest.raises((TypeError, RuntimeError)) as info:
        OptimizerConfig(optimizer="adam", use_distributed_optimizer=True, use_precision_aware_optimizer=True)
    assert info.type is TypeError or "TransformerEngine" in str(info.value), info.value
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|NVIDIA driver"):
        HybridDeviceOptimizer([torch.nn.Parameter(torch.zeros(4))], offload_fraction=1.0, lr=0.1,
                              cpu_optimizer_cls=torch.optim.AdamW, gpu_optimizer_cls=torch.optim.AdamW)
    override = f"+actor_rollout_ref.actor.optim.override_optimizer_config.{field}=true"
    with pytest.raises(ConfigError, match=f"override_optimizer_config.{field}=True with trainer.device=cpu"):
        load_and_validate(None, REQUIRED + ["trainer.device=cpu", override])
    auto = load_and_validate(None, REQUIRED + [override])  # trainer.device=auto: fine where CUDA is
    assert devices_from_config(auto, cuda_available=True).device == "cuda"
    with pytest.raises(ConfigError, match=field):
        devices_from_config(auto, cuda_available=False)
