"""The device decides the backends, in one place (docs/architecture.md, decision 9).

`decide_devices` turns `trainer.device`, whether CUDA is available, the placement mode, the rollout
engine and `actor_rollout_ref.rollout.weight_sync_transport` into the device of the training
roles, their torch.distributed backend, the weight-sync transport actually used with its group
backend, and the environment the training workers need (the CUDA connections megatron-core
schedules for: `cuda_connections_env`; SGLang's NCCL settings for a shared weight-update group, and
NCCL's watchdog: `nccl_watchdog_env`); or a ConfigError naming the keys of a combination that
cannot work. `auto_device_refusal` refuses `trainer.device=auto` where the controller that resolves
it cannot see the job's GPUs. It imports nothing heavy: the caller passes `cuda_available` (and the
facts `auto_device_refusal` reads).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

from megarl.config.errors import ConfigError
from megarl.config.fp8_training import DEFAULT_RECIPE, fp8_device_problem, fp8_format
from megarl.config.profiler import profiler_device_problem
from megarl.config.rules.fsdp2 import fsdp2_switch
from megarl.config.schema import ExperimentConfig

TRANSPORT_KEY = "actor_rollout_ref.rollout.weight_sync_transport"

# What SGLang forces in its own processes (sglang/srt/entrypoints/engine.py::_set_envs_and_config):
# NCCL_CUMEM_ENABLE=0, NCCL_NVLS_ENABLE=0. A trainer in the same NCCL weight-update group must
# agree, as slime (ray/actor_group.py) and AReaL (infra/launcher/*.py) set them for theirs.
NCCL_WEIGHT_GROUP_ENV = (("NCCL_CUMEM_ENABLE", "0"), ("NCCL_NVLS_ENABLE", "0"))

# torch's own default of TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (ProcessGroupNCCL.cpp, HeartbeatMonitor:
# 60 * 8 s), raised from 2 min because shorter values killed jobs that would have completed
# (pytorch/pytorch#116267, #133028).
TORCH_HEARTBEAT_DEFAULT_S = 480


# What megatron-core's overlapped communication is written for (below: `cuda_connections_env`).
CUDA_CONNECTIONS_ENV = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)


def cuda_connections_env(device: str) -> tuple[tuple[str, str], ...]:
    """(name, value) of the CUDA runtime the training workers on `device` ("cuda" or "cpu", as
    decided) start with: CUDA_DEVICE_MAX_CONNECTIONS=1 on CUDA, nothing on CPU.

    The CUDA runtime reads it when CUDA initialises in the process (CUDA Programming Guide, "CUDA
    Environment Variables": the number of compute and copy engine connections, or work queues, from
    the host to each device; default 8), so it must be in the worker's environment when the process
    starts (the Ray actor's runtime_env, `WorkerGroup`), not set from Python once torch may have
    touched CUDA. With one work queue, kernels start in the order they were launched, whatever their
    stream. megatron-core (0.16.1) launches its asynchronous collectives first for exactly that
    reason:
    - tensor_parallel/layers.py, `LinearWithGradAccumulationAndAsyncCommunication.backward`:
      "Here we rely on CUDA_DEVICE_MAX_CONNECTIONS=1 to ensure that the" sequence-parallel
      all-gather, and the input-gradient all-reduce or reduce-scatter, "is scheduled before" the
      gradient GEMMs it overlaps; `linear_with_grad_accumulation_and_async_allreduce` warns "When
      using sequence parallelism it is recommended to set the environment variable
      CUDA_DEVICE_MAX_CONNECTIONS to 1" (and the same for the async gradient all-reduce at TP > 1);
    - distributed/distributed_data_parallel.py (bucket groups, overlap_grad_reduce): "because of the
      use of CUDA_DEVICE_MAX_CONNECTIONS=1, having multiple back-to-back communications will
      prevent the overlap".
    Megatron-LM's own trainer refuses TP > 1 or CP > 1 without it before Blackwell
    (megatron/training/arguments.py::validate_args: "Using tensor model parallelism or context
    parallelism require setting the environment variable CUDA_DEVICE_MAX_CONNECTIONS to 1"). Its
    exceptions only warn: FSDP (megarl trains without it) and overlap_moe_expert_parallel_comm
    (megarl sets it nowhere; a user's override_transformer_config may, and Megatron-LM then leaves
    "1 or 32" to whichever overlap is to be preferred). The one place megatron-core wants it other
    than 1, the UCC pipeline backend (parallel_state.py: "UCC-backend requires
    CUDA_DEVICE_MAX_CONNECTIONS > 1"), megarl never selects (engines/megatron/parallel.py passes no
    pipeline_model_parallel_comm_backend). One environment serves every training role, whatever its
    layout: 1 on CUDA. On CPU there is no CUDA context and nothing to set."""
    return CUDA_CONNECTIONS_ENV if device == "cuda" else ()


def nccl_watchdog_env(collective_timeout_s: float) -> tuple[tuple[str, str], ...]:
    """(name, value) of ProcessGroupNCCL's watchdog for processes whose collectives are bounded by
    `collective_timeout_s` seconds (actor_rollout_ref.nccl_timeout, > 0: checked at load time).

    The rule is PyTorch's "PYTORCH ProcessGroupNCCL Environment Variables" page
    (docs.pytorch.org/docs/stable/torch_nccl_environment_variables.html):
    - TORCH_NCCL_ASYNC_ERROR_HANDLING=1: "aborting NCCL communicator and tearing down process upon
      error"; a collective past its timeout (or failed) ends the process instead of hanging it
      (torch's default, 3, tears down without aborting the communicator).
    - TORCH_NCCL_ENABLE_MONITORING=1: the monitoring thread "aborts the process when the
      ProcessGroupNCCL Watchdog thread gets stuck and no heartbeat is detected after
      TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" ("calling CUDA/NCCL APIs that may hang").
    - TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC = max(torch's default 480, ceil(collective_timeout_s)). The
      heartbeat counts the watchdog's own loop, not a collective's progress: a long collective keeps
      it beating. The watchdog stalls where the CUDA/NCCL call it polls is blocked by legitimate slow
      work ("another thread holding the GIL inside a CUDA api", torch's own message; a slow
      communicator set-up); the collective timeout is the user's statement of how long such work may
      legitimately take, so a heartbeat shorter than it would let the monitor kill, with a generic
      "watchdog got stuck", a process the collective bound still allows, before its collective can
      time out with its own error. Never below torch's default. The cost: a watchdog stuck for real,
      or a tear-down that hangs after a timeout (the monitor then waits one heartbeat timeout,
      HeartbeatMonitor::runLoop), is killed after this many seconds instead of 480.
    TORCH_NCCL_DUMP_ON_TIMEOUT and TORCH_NCCL_TRACE_BUFFER_SIZE (the flight recorder, a debugging
    aid) stay at torch's defaults."""
    heartbeat_s = max(TORCH_HEARTBEAT_DEFAULT_S, math.ceil(collective_timeout_s))
    return (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"), ("TORCH_NCCL_ENABLE_MONITORING", "1"),
            ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(heartbeat_s)))


@dataclass(frozen=True)
class Devices:
    """Where the training roles run and how their processes talk."""

    device: Literal["cuda", "cpu"]
    training_backend: str  # torch.distributed backend of each training role's world
    weight_sync_transport: Literal["distributed", "tensor", "disk"]
    weight_sync_backend: Optional[str]  # of the distributed weight-update group; None for tensor and disk
    nccl_env: tuple[tuple[str, str], ...] = ()  # (name, value) the training workers' processes need
    cuda_env: tuple[tuple[str, str], ...] = ()  # (name, value) of the CUDA runtime: `cuda_connections_env`

    @property
    def training_env(self) -> dict[str, str]:
        """The environment variables to start the training workers with."""
        return dict(self.cuda_env + self.nccl_env)

    def summary(self) -> str:
        """One line for logs and `megarl plan`."""
        sync = self.weight_sync_transport + (f" over {self.weight_sync_backend}" if self.weight_sync_backend else "")
        env = " ".join(f"{k}={v}" for k, v in self.training_env.items())
        return (f"device {self.device}, training groups {self.training_backend}, weight sync {sync}"
                + (f", trainer env {env}" if env else ""))


def decide_devices(device: str, cuda_available: bool, placement_mode: str, rollout_engine: str,
                   transport: str, *, collective_timeout_s: float, nnodes: int = 1) -> Devices:
    """`device`: trainer.device (auto|cuda|cpu); `placement_mode`: placement.mode (colocate|split);
    `rollout_engine`: actor_rollout_ref.rollout.name (sglang|cpu); `transport`:
    actor_rollout_ref.rollout.weight_sync_transport (auto|distributed|tensor|disk);
    `collective_timeout_s`: actor_rollout_ref.nccl_timeout (seconds; NCCL's watchdog on CUDA);
    `nnodes`: trainer.nnodes."""
    if device == "cuda" and not cuda_available:
        raise ConfigError("trainer.device=cuda, but this machine has no CUDA GPU (torch.cuda.is_available() is "
                          "False); use trainer.device=cpu or auto")
    on_cuda = device == "cuda" or (device == "auto" and cuda_available)
    where = f"trainer.device={device}" + (f" (resolved to {'cuda' if on_cuda else 'cpu'})" if device == "auto" else "")
    colocated = placement_mode == "colocate"

    if transport == "auto":
        # Colocated on GPUs a distributed group is impossible (below): the servers get CUDA IPC
        # handles. The planner's colocated layout puts actor rank g and one server TP rank on every
        # GPU g of the pool (sync/colocation.py::planner_colocated_peers), so every TP rank gets a
        # copy serialised by the actor rank on its own GPU (sync/ipc_copies.py), on any number of GPUs.
        if on_cuda and colocated and rollout_engine == "sglang":
            transport = "tensor"
        else:
            transport = "distributed"
    if transport == "tensor":
        # The tensor transport hands each server TP rank a handle to a copy of the weights it can
        # open: CUDA IPC handles open only on the GPU of the memory they name (torch.multiprocessing,
        # "CUDA in multiprocessing"; SGLang's TP rank r reads entry r,
        # sglang/srt/managers/tp_worker.py::deserialize_own_rank), so entry r is serialised by the
        # actor rank colocated with TP rank r, which only colocated placement has (split: none);
        # CPU tensors are shared through shared memory of one machine (torch.multiprocessing,
        # file_system strategy).
        if not colocated:
            raise ConfigError(f"{TRANSPORT_KEY}=tensor hands the rollout servers handles to the trainer's own "
                              f"memory: it needs placement.mode=colocate, not {placement_mode}; use "
                              f"{TRANSPORT_KEY}=distributed or auto")
        if on_cuda and rollout_engine != "sglang":
            raise ConfigError(f"{TRANSPORT_KEY}=tensor on GPUs needs actor_rollout_ref.rollout.name=sglang: the CPU "
                              f"engine ({rollout_engine}) reads CPU tensors only; use distributed or disk")
        if not on_cuda and nnodes > 1:
            raise ConfigError(f"{TRANSPORT_KEY}=tensor on CPU shares tensors through one machine's shared memory, "
                              f"but trainer.nnodes={nnodes}; use {TRANSPORT_KEY}=distributed or auto")
    if transport == "distributed" and on_cuda and colocated and rollout_engine == "sglang":
        # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected : rank X
        # and rank Y both on CUDA device", NVIDIA/Megatron-LM#661); colocated, a server TP rank
        # sits on the emitting trainer rank's GPU.
        raise ConfigError(f"{TRANSPORT_KEY}=distributed cannot run with placement.mode=colocate on GPUs ({where}): "
                          "NCCL refuses two ranks of one communicator on one GPU (\"Duplicate GPU detected\"), and "
                          "colocated a rollout server's TP rank shares the emitting trainer rank's GPU; use "
                          f"{TRANSPORT_KEY}=auto (tensor here), tensor or disk, or "
                          "placement.mode=split")

    sync_backend = None
    if transport == "distributed":
        # SGLang's weight-update group holds its GPU ranks: NCCL (sglang's /init_weights_update_group
        # default). The CPU engine's tensors are on the CPU: gloo, which also takes CUDA tensors for
        # broadcast (PyTorch's backend support table).
        sync_backend = "nccl" if on_cuda and rollout_engine == "sglang" else "gloo"
    if not on_cuda:
        return Devices("cpu", "gloo", transport, sync_backend, (), cuda_connections_env("cpu"))
    # PyTorch's backend support table: gloo cannot send, recv or barrier CUDA tensors, and megatron's
    # pipeline is send/recv; megatron's TP/PP/DP groups inherit the world's backend
    # (parallel_state.create_group(backend=None)). So CUDA tensors go over NCCL and CPU objects over
    # gloo, one default group for both (verl: utils/distributed.py).
    nccl_env = weight_group_nccl_env(sync_backend) + nccl_watchdog_env(collective_timeout_s)
    return Devices("cuda", "cpu:gloo,cuda:nccl", transport, sync_backend, nccl_env, cuda_connections_env("cuda"))


# Where the controller's environment shows the job's GPUs. Slurm (man sbatch / srun, OUTPUT
# ENVIRONMENT VARIABLES): SLURM_GPUS_ON_NODE "Number of GPUs allocated to the batch step";
# SLURM_JOB_GPUS "The global GPU IDs of the GPUs allocated to this job" (SLURM_STEP_GPUS: of the
# step); SLURM_GPUS "Number of GPUs requested" (-G, --gpus) and SLURM_GPUS_PER_NODE "Requested GPU
# count per allocated node" (--gpus-per-node, as slurm/megarl.sbatch asks), both "[type:]count".
# CUDA: CUDA_VISIBLE_DEVICES lists indexes or GPU-/MIG- UUIDs, and only the devices before the first
# invalid entry are visible (CUDA C Programming Guide, "CUDA Environment Variables"), so "-1", ""
# or Slurm's "NoDevFiles" name none.
GPU_ENV_VARS = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS", "SLURM_GPUS_PER_NODE",
                "CUDA_VISIBLE_DEVICES")


def _names_gpus(name: str, value: str) -> bool:
    """Whether `value` of the variable `name` (one of GPU_ENV_VARS) says there are GPUs."""
    value = value.strip()
    if name == "SLURM_GPUS_ON_NODE":
        return value.isdigit() and int(value) > 0
    if name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):  # ids: 0,1,... (or ranges, 0-3)
        return bool(value) and value[0].isdigit()
    if name in ("SLURM_GPUS", "SLURM_GPUS_PER_NODE"):  # [type:]count[,[type:]count...]
        counts = [item.rsplit(":", 1)[-1].strip() for item in value.split(",")]
        return any(c.isdigit() and int(c) > 0 for c in counts)
    first = value.split(",")[0].strip()  # CUDA_VISIBLE_DEVICES: the first entry decides whether any is visible
    return first.isdigit() or first.startswith(("GPU-", "MIG-"))


def job_gpu_env(env: Mapping[str, str]) -> tuple[str, ...]:
    """`NAME=value` of every variable of `env` (GPU_ENV_VARS) that says this process's job has GPUs."""
    return tuple(f"{name}={env[name]}" for name in GPU_ENV_VARS if name in env and _names_gpus(name, env[name]))


def auto_device_refusal(device: str, cuda_available: bool, cluster_gpus: Optional[float],
                        env: Mapping[str, str]) -> Optional[str]:
    """Why `trainer.device` (`device`) must not be resolved here, or None. The caller gathers the
    facts: `cuda_available`, whether this (the controller's) process sees a CUDA GPU
    (torch.cuda.is_available()); `cluster_gpus`, the GPUs of the Ray cluster it joined (None when it
    joined none: before Ray starts, or a cluster it started itself with the config's logical GPUs);
    `env`, its environment (GPU_ENV_VARS).

    `auto` is decided by the controller, and the workers follow it (`decide_devices`): CPU and gloo
    where it sees no GPU. The controller is not where the training runs: a Slurm batch step given
    none of the job's GPUs, a login or head node without them, a CPU-only torch on a GPU node, would
    each silently train a GPU job on CPU. So when the controller sees no CUDA but the job shows GPUs
    (the cluster advertises some, or the environment lists some), `auto` is refused, naming the
    key; `cuda` and `cpu` are the user's own decision and pass (`cuda` without CUDA here is
    `decide_devices`' refusal)."""
    if device != "auto" or cuda_available:
        return None
    shown = ([f"the Ray cluster it joined (RAY_ADDRESS) advertises {cluster_gpus:g} GPU(s)"] if cluster_gpus else []) \
        + list(job_gpu_env(env))
    if not shown:
        return None
    return ("trainer.device=auto is decided on this controller, which sees no CUDA GPU (torch.cuda.is_available() "
            "is False: a Slurm batch step given none of the job's GPUs, no driver here, or a CPU-only torch), so the "
            f"run would train on CPU over gloo; but this job has GPUs: {'; '.join(shown)}. Set trainer.device=cuda "
            "to train on them (slurm/megarl.sbatch's usage and `megarl submit` do), or trainer.device=cpu if they are "
            "not this run's (Ray's logical GPUs of a CPU machine, e.g. launch/local.sh on CPU)")


# megatron-core's OptimizerConfig fields that cannot work on a CPU, with the reason (0.16.1 and 0.19):
# the optimizer's CPU offload builds a HybridDeviceOptimizer, which takes CUDA streams when it is made
# (optimizer/cpu_offloading/hybrid_optimizer.py, `torch.cuda.current_stream()`); the precision-aware
# optimizer asks transformer-engine's version in OptimizerConfig.__post_init__ (`is_te_min_version`),
# and transformer-engine has no CPU build.
CUDA_ONLY_OPTIMIZER_FIELDS = {
    "optimizer_cpu_offload": "megatron-core's HybridDeviceOptimizer takes CUDA streams "
                             "(optimizer/cpu_offloading/hybrid_optimizer.py)",
    "use_precision_aware_optimizer": "megatron-core's OptimizerConfig needs transformer-engine for it "
                                     "(optimizer_config.py, is_te_min_version), which has no CPU build",
}


def optimizer_device_problems(device: str, overrides: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Why `optim.override_optimizer_config` of each trained role ({config section: overrides})
    cannot run on `device` ("cuda" or "cpu"): a CUDA-only field switched on (`CUDA_ONLY_OPTIMIZER_FIELDS`)."""
    if device != "cpu":
        return []
    return [f"{section}.optim.override_optimizer_config.{name}={value} with trainer.device=cpu: {reason}; "
            "drop it on a CPU"
            for section, fields in overrides.items() for name, reason in CUDA_ONLY_OPTIMIZER_FIELDS.items()
            if (value := fields.get(name))]


def fp8_device_problems(device: str, overrides: Mapping[str, Mapping[str, object]]) -> list[str]:
    """Why the FP8 training of each role ({config section: its megatron.override_transformer_config})
    cannot run on `device` ("cuda" or "cpu"): on a CPU, `fp8_training.fp8_device_problem`'s refusal.
    On CUDA, whether this GPU and its transformer-engine run the recipe is the engine's check when it
    builds the role (`engines.megatron.engine.MegatronEngine`)."""
    if device != "cpu":
        return []
    problems = []
    for section, fields in overrides.items():
        fmt = fp8_format(fields)
        problem = fp8_device_problem(fmt, fields.get("fp8_recipe", DEFAULT_RECIPE), on_cuda=False,
                                     transformer_engine_layers=False)
        if problem:
            problems.append(f"{section}.megatron.override_transformer_config.fp8={fmt} with trainer.device=cpu: "
                            f"{problem}")
    return problems


def devices_from_config(config: ExperimentConfig, cuda_available: bool) -> Devices:
    """`decide_devices` on the config's keys, then `optimizer_device_problems`, `fp8_device_problems` and
    `megarl.config.profiler.profiler_device_problem` on the device decided."""
    r = config.actor_rollout_ref.rollout
    t = config.trainer
    devices = decide_devices(t.device, cuda_available, config.placement.mode, r.name, r.weight_sync_transport,
                             collective_timeout_s=config.actor_rollout_ref.nccl_timeout, nnodes=t.nnodes)
    # a role on FSDP2 builds no megatron-core optimizer (config.rules.fsdp2 decides its overrides)
    roles = (("actor_rollout_ref.actor", config.actor_rollout_ref.actor, True),
             ("critic", config.critic, config.critic.enable))
    megatron_optimizer = {section: cfg.optim.override_optimizer_config for section, cfg, on in roles
                          if on and fsdp2_switch(cfg.megatron) is None}
    problems = optimizer_device_problems(devices.device, megatron_optimizer)
    actor, ref = (config.actor_rollout_ref.actor.megatron.override_transformer_config,
                  config.actor_rollout_ref.ref.megatron.override_transformer_config)
    problems += fp8_device_problems(devices.device, {  # the reference named where its overrides are its own
        "actor_rollout_ref.actor": actor, **({"actor_rollout_ref.ref": ref} if ref and ref != actor else {}),
        **({"critic": config.critic.megatron.override_transformer_config} if config.critic.enable else {}),
        **({"reward_model": config.reward_model.megatron.override_transformer_config}
           if config.reward_model.enable else {})})
    if problem := profiler_device_problem(config, devices.device):
        problems.append(problem)
    if problems:
        raise ConfigError("; ".join(problems))
    return devices


def visible_gpu_index(ray_gpu_ids: Sequence[object], cuda_visible_devices: Optional[str]) -> int:
    """The CUDA index, in this process, of its Ray actor's first GPU: torch's `cuda:<index>` and
    SGLang's `--base-gpu-id` (0.5.23 `arg_groups/fields/device.py`: the first GPU to allocate from)
    both count the GPUs this process sees, in the order of its CUDA_VISIBLE_DEVICES.

    Ray's GPU ids are *values* of the raylet's CUDA_VISIBLE_DEVICES (physical indexes when it has
    none). Ray narrows an actor's CUDA_VISIBLE_DEVICES to its own GPUs, unless
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 (the rollout actors) keeps the raylet's list:
    - CUDA_VISIBLE_DEVICES unset or empty: every GPU is visible in physical order, the id is the index;
    - a list (indexes or GPU-/MIG- UUIDs): the position of the id in it."""
    if not ray_gpu_ids:
        raise ValueError("this process holds no GPU from Ray (ray.get_gpu_ids() is empty); was its actor given "
                         "num_gpus?")
    first = str(ray_gpu_ids[0]).strip()
    if cuda_visible_devices is None or not cuda_visible_devices.strip():
        if not first.isdigit():
            raise ValueError(f"Ray GPU id {first!r} is not an index and CUDA_VISIBLE_DEVICES is unset")
        return int(first)
    visible = [d.strip() for d in cuda_visible_devices.split(",")]
    if first not in visible:
        raise ValueError(f"Ray GPU id {first!r} is not in this process's CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")
    return visible.index(first)


def weight_group_nccl_env(weight_sync_backend: Optional[str]) -> tuple[tuple[str, str], ...]:
    """The NCCL variables a training worker needs for SGLang's weight-update group: SGLang's own
    (`NCCL_WEIGHT_GROUP_ENV`) when that group is NCCL, none otherwise (gloo, tensor handles, disk).
    `decide_devices` puts exactly these (before the watchdog's) into `Devices.nccl_env`.

    They go into the environment of every training process, so `NCCL_NVLS_ENABLE=0` also turns
    NVLink SHARP off for the training groups (TP/DP/PP), not only for the weight-update group.
    That cannot be narrowed to the one group (NCCL 2.30.7 sources, NVIDIA/nccl@5067397):
    - NCCL reads its variables once per process: `NCCL_PARAM(NvlsEnable, "NVLS_ENABLE", 2)`
      (src/transport/nvls.cc) caches the first value it reads in a static (src/include/param.h;
      the opt-out `NCCL_NO_CACHE`, NCCL >= 2.29.7, is a private parameter: docs/userguide/source/
      api/param.rst), and the first communicator of the process reads it, whichever group that
      is. Setting it around the weight group's creation would change nothing afterwards, or
      everything before.
    - No per-communicator switch exists: `ncclConfig_t` (src/nccl.h.in) has `nvlsCTAs` but no
      NVLS on/off, and `nvlsCTAs` must be > 0 (src/init.cc: "Invalid config nvlsCTAs attribute
      value"); `ncclNvlsInit` (src/transport/nvls.cc) decides `nvlsSupport` from the process-wide
      parameter and the hardware only. Nor could torch pass one: `ProcessGroupNCCL.Options().config`
      (`pg_options` of `new_group`) exposes blocking, cga_cluster_size, min_ctas and max_ctas
      (torch 2.13 torch/_C/_distributed_c10d.pyi).
    The cost is NVLink SHARP for the training collectives on NVSwitch (NVLink4+) systems; it is paid
    only with split placement and the distributed transport (colocated GPUs use tensor handles:
    `decide_devices`). NCCL agrees on NVLS per communicator by the minimum over its ranks
    (src/init.cc, `graphs[NCCL_ALGO_NVLS]->nChannels == 0` after the all-gather), which suggests
    a trainer with NVLS on could still join SGLang's group (NVLS off there); AReaL sets both
    variables as "Required by NCCL weight update group", and no GPU run here has shown otherwise,
    so megarl keeps SGLang's settings."""
    return NCCL_WEIGHT_GROUP_ENV if weight_sync_backend == "nccl" else ()
