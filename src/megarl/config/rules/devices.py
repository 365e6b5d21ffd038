"""Rules on devices: the weight-sync transport against the placement and the device, by the same
decision (`megarl.config.devices.decide_devices`) the trainer applies when the run starts."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.devices import devices_from_config
from megarl.config.errors import ConfigError
from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig


def weight_sync_transport_fits_devices(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The weight-sync transport must work on the device and placement: e.g. no distributed (NCCL)
    group colocated on GPUs, no tensor (CUDA IPC) transport on CPU or split placement. With
    trainer.device=auto the device is known only on the machine that runs, so only a combination
    that fails on both CUDA and CPU is refused here; the trainer checks the rest when it starts.
    The same decision refuses the CUDA-only optimizer options and FP8 training on a CPU
    (`optimizer_device_problems`, `fp8_device_problems`) and the GPU-only profilers
    (`profiler_device_problem`).

    Reads: trainer.device, placement.mode, actor_rollout_ref.rollout.name,
    actor_rollout_ref.rollout.weight_sync_transport, trainer.nnodes, actor_rollout_ref.nccl_timeout,
    actor_rollout_ref.actor.optim.override_optimizer_config, critic.optim.override_optimizer_config, critic.enable,
    actor_rollout_ref.actor.megatron.use_torch_fsdp2, actor_rollout_ref.actor.megatron.use_megatron_fsdp,
    critic.megatron.use_torch_fsdp2, critic.megatron.use_megatron_fsdp,
    actor_rollout_ref.actor.megatron.override_transformer_config, actor_rollout_ref.ref.megatron.override_transformer_config,
    critic.megatron.override_transformer_config, reward_model.enable, reward_model.megatron.override_transformer_config,
    global_profiler,
    actor_rollout_ref.actor.profiler, actor_rollout_ref.ref.profiler, actor_rollout_ref.rollout.profiler, critic.profiler
    """
    # An explicit device is taken as available: whether this machine has it is the preflight's check.
    candidates = {"cuda": [True], "cpu": [False]}.get(config.trainer.device, [True, False])
    problems = []
    for cuda_available in candidates:
        try:
            devices_from_config(config, cuda_available)
        except ConfigError as problem:
            problems.append(str(problem))
    if len(problems) == len(candidates):
        yield problems[0]

