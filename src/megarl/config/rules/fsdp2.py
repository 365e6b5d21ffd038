"""Rules on `<role>.megatron.use_torch_fsdp2` and verl's `use_megatron_fsdp` (both PyTorch FSDP2 in place of
megatron's DDP and optimizer, megarl.engines.megatron.fsdp2) for the roles that train: the actor, and the
critic where it runs."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig, MegatronConfig

def fsdp2_switch(megatron: MegatronConfig) -> Optional[str]:
    """The key that puts a trained role on megarl's FSDP2 (`megatron.<key>`): "use_torch_fsdp2", or verl's
    "use_megatron_fsdp" (Megatron-FSDP's ZeRO-3 sharding, which megarl runs with torch FSDP2:
    `megatron_fsdp_runs_as_fsdp2`); None: megatron's DDP."""
    if megatron.use_torch_fsdp2:
        return "use_torch_fsdp2"
    return "use_megatron_fsdp" if megatron.use_megatron_fsdp else None


def _trained_roles(config: ExperimentConfig) -> list[tuple[str, object, object, object]]:
    """(key, megatron config, optim config, checkpoint config) of the roles that train with FSDP2 on."""
    actor = config.actor_rollout_ref.actor
    roles = [("actor_rollout_ref.actor", actor.megatron, actor.optim, actor.checkpoint)]
    if config.critic.enable:
        roles.append(("critic", config.critic.megatron, config.critic.optim, config.critic.checkpoint))
    return [role for role in roles if fsdp2_switch(role[1])]


def megatron_fsdp_runs_as_fsdp2(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Warnings: verl's `megatron.use_megatron_fsdp=true` on a trained role runs megarl's FSDP2: the same ZeRO-3
    sharding of parameters, gradients and optimizer state over DP x CP (verl's DistributedDataParallelConfig:
    data_parallel_sharding_strategy="optim_grads_params"), AdamW on float32 shards, the gradient clipped by its
    global norm. megatron-core's own Megatron-FSDP is not what runs: it is CUDA-only (megatron_fsdp.py
    MegatronFSDP.__init__ calls torch.cuda.current_device()) and megarl does not build it. On a forward-only
    role the key has no effect, in verl too (its engine builds such a role with wrap_with_ddp=False:
    verl/workers/engine/megatron/transformer_impl.py::_build_megatron_module).

    Reads: actor_rollout_ref.actor.megatron.use_megatron_fsdp, actor_rollout_ref.actor.megatron.use_torch_fsdp2,
    critic.enable, critic.megatron.use_megatron_fsdp, critic.megatron.use_torch_fsdp2,
    actor_rollout_ref.ref.megatron.use_megatron_fsdp, reward_model.megatron.use_megatron_fsdp
    """
    for key, megatron, _, _ in _trained_roles(config):
        if fsdp2_switch(megatron) == "use_megatron_fsdp":
            yield (f"{key}.megatron.use_megatron_fsdp=true: megarl shards this role with PyTorch FSDP2 "
                   f"({key}.megatron.use_torch_fsdp2: parameters, gradients and AdamW state over the DP x CP ranks, "
                   "as Megatron-FSDP's optim_grads_params); megatron-core's Megatron-FSDP itself is CUDA-only and "
                   "not built in megarl")
    for key, megatron in (("actor_rollout_ref.ref", config.actor_rollout_ref.ref.megatron),
                          ("reward_model", config.reward_model.megatron)):
        if megatron.use_megatron_fsdp:
            yield (f"{key}.megatron.use_megatron_fsdp=true has no effect: a forward-only role is not wrapped for "
                   "data parallelism (verl builds it with wrap_with_ddp=False too), so there is nothing to shard")


# megatron-core OptimizerConfig fields (optimizer/optimizer_config.py, 0.16.1 and 0.19) that tune its host-side
# optimizer step, the HybridDeviceOptimizer that optimizer_cpu_offload builds (optimizer/__init__.py), which FSDP2
# does not run
HOST_STEP_FIELDS = ("overlap_cpu_optimizer_d2h_h2d", "use_torch_optimizer_for_cpu_offload", "pin_cpu_grads",
                    "pin_cpu_params")
# the precision-aware optimizer's dtypes (OptimizerConfig: "dtype of main grads / main params / exp_avg / exp_avg_sq
# when enabling precision-aware-optimizer", torch.float32 by default; __post_init__ asserts float32 without it)
PRECISION_DTYPE_FIELDS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
FLOAT32_NAMES = ("float32", "fp32", "torch.float32")  # str(torch.float32) is "torch.float32"


def fsdp2_optimizer_overrides(overrides: Mapping[str, Any], optimizer_offload: bool, role: str,
                              switch: str) -> tuple[list[str], list[str]]:
    """(warnings, refusals) for `<role>.optim.override_optimizer_config` (`overrides`) on a role trained with FSDP2
    (`<role>.megatron.<switch>`), whose optimizer is torch's AdamW on the float32 shards on the device
    (engines.megatron.fsdp2), its state moved to host memory between phases where `optimizer_offload`
    (`<role>.megatron.optimizer_offload`, colocated placement). Each megatron-core OptimizerConfig field
    (optimizer_config.py, quoted) is accepted where FSDP2 computes what it asks, with a warning where the
    memory differs; refused, naming the key, where the numbers would differ:
    - decoupled_weight_decay: "If true, decouples weight decay from the gradient update, equivalent to AdamW.
      If false, original Adam update rule will be used": true is FSDP2's AdamW (accepted), false refused.
    - optimizer_cpu_offload ("offload optimizer states tensor and compute to CPU") and
      optimizer_offload_fraction ("the fraction of optimizer states to offload from GPU memory to CPU", read
      only with optimizer_cpu_offload: optimizer/__init__.py; Megatron Lite's offload_fraction): fraction 1.0,
      the whole state and step on the host, is nearest megatron.optimizer_offload (the state on the host
      between phases, on the device in the step: the same AdamW): accepted with a warning where that key is on,
      refused naming it where it is off; a fraction in (0, 1) (a part of the state on the host in the step)
      refused; a fraction of 0 or one without optimizer_cpu_offload has no effect in megatron-core: a warning.
    - HOST_STEP_FIELDS tune that host step: no effect, a warning.
    - use_precision_aware_optimizer ("allows optimizer-related tensors (master_param, gradients and optimizer
      states) to be set to lower precision", by PRECISION_DTYPE_FIELDS): with those float32, the defaults, the
      tensors are float32 as FSDP2 keeps them: accepted with a warning; one at another dtype refused.
    - any other field refused: FSDP2's AdamW reads megarl's own optim keys only."""
    prefix, m = f"{role}.optim.override_optimizer_config", f"{role}.megatron"
    why = f"with {m}.{switch}=true: not built yet with megatron.{switch}"
    warnings, refusals = [], []
    cpu_offload = bool(overrides.get("optimizer_cpu_offload", False))
    for name, value in overrides.items():
        key = f"{prefix}.{name}={value}"
        if name == "decoupled_weight_decay":
            if not value:
                refusals.append(f"{key} {why}: the FSDP2 optimizer is AdamW (decoupled weight decay)")
        elif name == "optimizer_offload_fraction":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                refusals.append(f"{key}: a fraction in [0, 1] of the optimizer state (megatron-core OptimizerConfig)")
            elif not cpu_offload or value == 0.0:
                warnings.append(f"{key} has no effect with {prefix}.optimizer_cpu_offload="
                                f"{overrides.get('optimizer_cpu_offload', False)} (megatron-core offloads nothing)")
            elif value < 1.0:
                refusals.append(f"{key} {why}: a part of the optimizer state on the host in the step (1.0, the "
                                f"whole state on the host between phases with {m}.optimizer_offload=true, is built)")
            elif not optimizer_offload:
                refusals.append(f"{key} {why}: the AdamW step on the host; set {m}.optimizer_offload=true to keep the "
                                "AdamW state on the host between phases (the step runs on the device)")
            else:
                warnings.append(f"{key} with {prefix}.optimizer_cpu_offload=true and {m}.{switch}=true: the AdamW "
                                f"state is on the host between phases ({m}.optimizer_offload=true) but on the device "
                                "in the update (8 bytes per parameter / DP x CP more device memory than megatron-"
                                "core's host step), and the step runs there: the same AdamW update, up to the "
                                "rounding of another device's kernels")
        elif name == "optimizer_cpu_offload":
            if value and "optimizer_offload_fraction" not in overrides:
                warnings.append(f"{key} has no effect with {prefix}.optimizer_offload_fraction=0.0, its default "
                                "(megatron-core offloads nothing)")
        elif name in HOST_STEP_FIELDS:
            warnings.append(f"{key} has no effect with {m}.{switch}=true: it tunes megatron-core's host optimizer "
                            "step, which the FSDP2 AdamW does not run")
        elif name == "use_precision_aware_optimizer":
            lower = [f for f in PRECISION_DTYPE_FIELDS if str(overrides.get(f, "float32")) not in FLOAT32_NAMES]
            if value and not lower:
                warnings.append(f"{key} with {m}.{switch}=true: its main parameters, gradients and optimizer states "
                                f"are float32 ({', '.join(PRECISION_DTYPE_FIELDS)} default), as the FSDP2 AdamW "
                                "keeps them: no effect")
        elif name in PRECISION_DTYPE_FIELDS:
            if str(value) not in FLOAT32_NAMES:
                refusals.append(f"{key} {why}: the FSDP2 AdamW keeps its parameters, gradients and state in float32")
        else:
            refusals.append(f"{key} {why} (a megatron-core OptimizerConfig field; the FSDP2 AdamW reads megarl's "
                            "optim keys only)")
    return warnings, refusals


def fsdp2_optimizer_override_warnings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Warnings: the fields of `optim.override_optimizer_config` that a role trained with FSDP2 accepts with a
    difference or with no effect (`fsdp2_optimizer_overrides`; its refusals: `torch_fsdp2_fits`).

    Reads: actor_rollout_ref.actor.megatron, critic.megatron, critic.enable, actor_rollout_ref.actor.optim,
    critic.optim
    """
    for key, megatron, optim, _ in _trained_roles(config):
        yield from fsdp2_optimizer_overrides(optim.override_optimizer_config, megatron.optimizer_offload, key,
                                             fsdp2_switch(megatron))[0]


def torch_fsdp2_fits(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A trained role with `megatron.use_torch_fsdp2=true` uses only what is built (each refusal names
    its key; pipeline parallelism, with virtual stages and tied embeddings, is built, and MoE models with
    expert parallelism, the experts sharded over megatron's expert-DP group): no distributed optimizer
    (FSDP2 shards the optimizer state itself), no sequence parallelism (its norms' gradient all-reduce
    over TP is megatron DDP's), no LoRA, QAT or MTP training, no fp16 (megatron's loss scaler is its
    optimizer's), Adam only with the `optim.override_optimizer_config` fields `fsdp2_optimizer_overrides`
    accepts, and no background checkpoint write (`checkpoint.async_save`: its checkpoints are written in
    the foreground, engines.megatron.fsdp2_checkpoint; saving and resuming are built; an MoE router's
    expert bias is updated as megatron's DDP does). A forward-only role ignores the key.

    Reads: actor_rollout_ref.actor.megatron, critic.megatron, critic.enable, actor_rollout_ref.actor.optim,
    critic.optim, actor_rollout_ref.model.dtype, actor_rollout_ref.model.lora, critic.model.lora,
    actor_rollout_ref.model.mtp, actor_rollout_ref.actor.checkpoint, critic.checkpoint
    """
    for key, megatron, optim, checkpoint in _trained_roles(config):
        m, switch = f"{key}.megatron", fsdp2_switch(megatron)
        why = f"with {m}.{switch}=true: not built yet with megatron.{switch}"
        # megatron-core's Megatron-FSDP requires the distributed optimizer flag, which verl sets with it
        if megatron.use_distributed_optimizer and switch == "use_torch_fsdp2":
            yield (f"{m}.use_distributed_optimizer=true with {m}.use_torch_fsdp2=true: FSDP2 shards the optimizer "
                   "state itself; set use_distributed_optimizer=false")
        if megatron.sequence_parallel and megatron.tensor_model_parallel_size > 1:
            yield f"{m}.sequence_parallel=true {why}"
        if megatron.qat.enable:
            yield f"{m}.qat.enable=true {why}"
        if optim.optimizer != "adam":
            yield f"{key}.optim.optimizer={optim.optimizer} {why} (AdamW only)"
        yield from fsdp2_optimizer_overrides(optim.override_optimizer_config, megatron.optimizer_offload, key,
                                             switch)[1]
        lora = config.actor_rollout_ref.model.lora if key.startswith("actor") else config.critic.model.lora
        if lora.rank > 0:
            yield f"{key.rsplit('.', 1)[0] if key.startswith('actor') else key}.model.lora.rank={lora.rank} {why}"
        mtp = config.actor_rollout_ref.model.mtp
        if key.startswith("actor") and mtp.enable and mtp.enable_train:
            yield f"actor_rollout_ref.model.mtp.enable_train=true {why}"
        if config.actor_rollout_ref.model.dtype == "float16":
            yield f"actor_rollout_ref.model.dtype=float16 {why} (bfloat16 and float32 are)"
        if checkpoint.async_save:
            yield (f"{key}.checkpoint.async_save=true {why} (its checkpoints are written in the foreground); set "
                   "async_save=false")
