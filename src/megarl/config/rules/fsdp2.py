"""Rules on `<role>.megatron.use_torch_fsdp2` and verl's `use_megatron_fsdp` (both PyTorch FSDP2 in place of
megatron's DDP and optimizer, megarl.engines.megatron.fsdp2) for the roles that train: the actor, and the
critic where it runs."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

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


def torch_fsdp2_fits(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A trained role with `megatron.use_torch_fsdp2=true` uses only what FSDP2 builds (each refusal
    names its key): no distributed optimizer (FSDP2 shards the optimizer state itself), no pipeline
    parallelism (FSDP2 modules under megatron's pipeline schedules: not built), no sequence parallelism
    (its norms' gradient all-reduce over TP is megatron DDP's), no parameter / gradient / optimizer
    offload, no LoRA, QAT or MTP training, no fp16 (megatron's loss scaler is its optimizer's), Adam
    only with no `optim.override_optimizer_config`, and no background checkpoint write
    (`checkpoint.async_save`: its checkpoints are written in the foreground,
    engines.megatron.fsdp2_checkpoint; saving and resuming are built). MoE models train with expert
    parallelism (the experts sharded over megatron's expert-DP group); one with a router expert bias is
    refused when the engine reads the model's config. A forward-only role ignores the key.

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
        if megatron.pipeline_model_parallel_size > 1:
            yield f"{m}.pipeline_model_parallel_size={megatron.pipeline_model_parallel_size} {why}"
        if megatron.sequence_parallel and megatron.tensor_model_parallel_size > 1:
            yield f"{m}.sequence_parallel=true {why}"
        for part in ("param_offload", "grad_offload", "optimizer_offload"):
            if getattr(megatron, part):
                yield f"{m}.{part}=true {why}"
        if megatron.qat.enable:
            yield f"{m}.qat.enable=true {why}"
        if optim.optimizer != "adam":
            yield f"{key}.optim.optimizer={optim.optimizer} {why} (AdamW only)"
        if optim.override_optimizer_config:
            yield (f"{key}.optim.override_optimizer_config (sets {sorted(optim.override_optimizer_config)}) {why} "
                   "(megatron-core OptimizerConfig fields; the FSDP2 AdamW reads megarl's optim keys only)")
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
