"""megatron DDP, optimizer and learning-rate schedule of a trainable role, from its config.

Gradients are reduced in float32 buckets by megatron's DDP (averaged over data-parallel ranks;
with the distributed optimizer at DP > 1 overlapped with the backward pass, and the parameter
all-gather with the next forward: `ddp_overlap`);
the optimizer is megatron's (Adam with decoupled weight decay, none on biases and norms, gradient
clipping; float32 main weights under bf16/fp16; optionally the distributed optimizer) and the
schedule is megatron's `OptimizerParamScheduler` (linear warm-up, then constant, linear or cosine
decay to `optim.min_lr`, else `lr * min_lr_ratio`).

The schedule counts *updates* (calls of `update_policy` / `update_critic`, i.e. RL steps), as
`optim.total_training_steps` does: update k (k = 1, 2, ...) runs at the learning rate of
scheduler step k, so with warm-up W the first update uses lr / W (never a zero learning rate).
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl.engines.megatron.transformer_overrides import unknown_names

ADAM_EPS = 1e-8
DECAY_STYLES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


def ddp_overlap(*, trains: bool, dp_size: int, distributed_optimizer: bool) -> dict[str, bool]:
    """megatron `DistributedDataParallelConfig` overlap settings of a role: the gradient
    reduce-scatter overlapped with the backward pass and the parameter all-gather with the next
    forward pass, on whenever a trained role shards its optimizer over more than one DP rank.

    - `overlap_param_gather` needs the distributed optimizer and `overlap_grad_reduce`
      (Megatron-LM megatron/training/arguments.py::validate_args, d98e8a6: "--overlap-param-gather
      only supported with distributed optimizer", "Must use --overlap-param-gather with
      --overlap-grad-reduce"): only the distributed optimizer's step leaves each rank with its own
      shard of the updated parameters, and with the overlap its step skips the synchronous
      all-gather (megatron-core 0.16.1 and 0.19.2 optimizer/distrib_optimizer.py::step_with_ready_grads).
    - DP1 has nothing to overlap (a group of one). Forward-only roles (reference, reward model)
      are never DDP-wrapped (`MegatronEngine` builds DDP and an optimizer only with an `optim`
      config): `trains=False` gives all off. LoRA changes nothing: frozen parameters get no
      gradient buffer, and megatron's hooks skip them (distributed_data_parallel.py: "Skip
      parameters without an associated buffer").
    - `align_param_gather` stays off: Megatron-LM turns it off without the interleaved schedule
      (validate_args), and with it megatron launches the all-gathers from `config.param_sync_func`
      (pipeline_parallel/schedules.py), which megarl does not set; without it each bucket's
      all-gather starts in the forward pre-hook of the bucket before it. The optimizer's
      `overlap_param_gather_with_optimizer_step` stays off (validate_args: interleaved schedule
      only, and "not supported with distributed checkpointing yet", which megarl uses). The bucket
      size is megatron's default, max(40M, 1M x DP) parameters (distributed_data_parallel.py).
    - The same on CPU: megatron's gloo path runs it (../reference/megatron-on-cpu.md §5, "DP2,
      overlap_grad_reduce + overlap_param_gather": the same weights as the reference), so the CPU
      tests run the GPU code path. Its trap, parameters read before their all-gather landed, is
      the engine's to avoid (`finish_param_gather`; `gather_params_now` after every update, as
      Megatron-LM's training.py::force_param_sync before a checkpoint)."""
    overlap = trains and distributed_optimizer and dp_size > 1
    return {"overlap_grad_reduce": overlap, "overlap_param_gather": overlap, "align_param_gather": False}


def finish_param_gather(ddp_chunks: Optional[list], param: torch.Tensor) -> None:
    """Wait until `param`'s all-gather (`overlap_param_gather`) has landed. megatron waits in a
    forward pre-hook of the module that owns the parameter (`DistributedDataParallel.
    _make_forward_pre_hook`, which calls its bucket group's `finish_param_sync`); megarl's heads
    read the output layer's weight (or the value head's) outside that module's forward, so they
    must wait themselves. A no-op without DDP or without the overlap."""
    for chunk in ddp_chunks or ():
        group = chunk.param_to_bucket_group.get(param) if chunk.ddp_config.overlap_param_gather else None
        if group is not None:
            group.finish_param_sync()


def gather_params_now(ddp_chunks: Optional[list]) -> None:
    """Finish every parameter all-gather now (synchronously), so that every rank's parameters are
    the updated ones for whoever reads them directly: the weight push, checkpoints, exports.
    megatron-core's `DistributedDataParallel.start_param_sync(force_sync=True)`; a no-op
    without `overlap_param_gather` (the optimizer step then gathered already)."""
    for chunk in ddp_chunks or ():
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def wrap_ddp(chunks: list, config, use_distributed_optimizer: bool, overlap: dict[str, bool]) -> list:
    """Wrap each model chunk in megatron's DistributedDataParallel and hook the pipeline schedule
    to it (`no_sync_func`, `finalize_model_grads_func`). `overlap`: `ddp_overlap`'s settings."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer, **overlap
    )
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=v > 0) for v, chunk in enumerate(chunks)
    ]
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def optimizer_config_fields() -> set[str]:
    """The field names of the installed megatron-core's `OptimizerConfig`."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    return {f.name for f in dataclasses.fields(OptimizerConfig)}


def optimizer_kwargs(optim_cfg, params_dtype: torch.dtype, use_distributed_optimizer: bool, overlap_param_gather: bool,
                     fields: set[str], section: str) -> dict:
    """megatron-core `OptimizerConfig` arguments of an `OptimConfig`: megarl's own, then
    `optim.override_optimizer_config` on top (verl's key, applied the same way: verl/utils/megatron/
    optimizer.py `init_megatron_optim_config`). A name megarl derives from its keys may be repeated with
    the same value but not changed; an unknown name is refused. Raises ValueError listing every problem."""
    if len(optim_cfg.betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers, got {optim_cfg.betas}")
    derived = {
        "optimizer": (optim_cfg.optimizer, "optim.optimizer"),
        "lr": (optim_cfg.lr, "optim.lr"),
        "min_lr": (optim_cfg.final_lr(), "optim.min_lr (or optim.lr x optim.min_lr_ratio)"),
        "weight_decay": (optim_cfg.weight_decay, "optim.weight_decay"),
        "adam_beta1": (optim_cfg.betas[0], "optim.betas"),
        "adam_beta2": (optim_cfg.betas[1], "optim.betas"),
        "clip_grad": (optim_cfg.clip_grad, "optim.clip_grad"),
        "bf16": (params_dtype == torch.bfloat16, "actor_rollout_ref.model.dtype"),
        "fp16": (params_dtype == torch.float16, "actor_rollout_ref.model.dtype"),
        "params_dtype": (params_dtype, "actor_rollout_ref.model.dtype"),
        "use_distributed_optimizer": (use_distributed_optimizer, "megatron.use_distributed_optimizer"),
        "overlap_param_gather": (overlap_param_gather, "the DDP overlap (megarl.engines.megatron.optim.ddp_overlap)"),
    }
    kwargs = {name: value for name, (value, _) in derived.items()}
    kwargs["adam_eps"] = ADAM_EPS
    prefix = f"{section}.optim.override_optimizer_config"
    overrides = dict(optim_cfg.override_optimizer_config)
    problems = unknown_names(overrides, prefix, fields, "OptimizerConfig")
    for name, value in overrides.items():
        if name in derived and value != derived[name][0]:
            problems.append(f"{prefix}.{name}={value} conflicts with {derived[name][1]}, from which megarl sets "
                            f"{name}={derived[name][0]}; set that key only")
        elif name in fields:
            kwargs[name] = value
    if problems:
        raise ValueError("; ".join(problems))
    return kwargs


def build_optimizer(ddp_chunks: list, optim_cfg, params_dtype: torch.dtype, use_distributed_optimizer: bool, config,
                    overlap_param_gather: bool = False, section: str = "actor_rollout_ref.actor"):
    """megatron's optimizer over the DDP-wrapped chunks, from an `OptimConfig` (`optimizer_kwargs`).
    `overlap_param_gather`: the DDP config's (OptimizerConfig's field "is intended to have the same
    value", megatron-core optimizer_config.py)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    kwargs = optimizer_kwargs(optim_cfg, params_dtype, use_distributed_optimizer, overlap_param_gather,
                              optimizer_config_fields(), section)
    optimizer = get_megatron_optimizer(OptimizerConfig(**kwargs), ddp_chunks)
    if params_dtype == torch.float16:
        config.grad_scale_func = optimizer.scale_loss  # dynamic loss scaling
    return optimizer


def build_scheduler(optimizer, optim_cfg, section: str):
    """megatron's `OptimizerParamScheduler` for an `OptimConfig` (`section` names it in errors)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    style = DECAY_STYLES[optim_cfg.warmup_style]
    warmup, decay = optim_cfg.schedule_steps()
    if decay <= 0:
        if optim_cfg.lr_warmup_steps < 0 and optim_cfg.lr_warmup_steps_ratio > 0:
            raise ValueError(
                f"{section}.optim.lr_warmup_steps_ratio={optim_cfg.lr_warmup_steps_ratio} needs "
                f"{section}.optim.total_training_steps (-1 was not filled in by the trainer) or lr_decay_steps"
            )
        if style != "constant":
            raise ValueError(
                f"{section}.optim.warmup_style={optim_cfg.warmup_style} decays the learning rate over "
                f"{section}.optim.total_training_steps, which is {decay} (not filled in by the trainer)"
            )
        decay = warmup + 1  # constant after warm-up: the decay length is never reached
    if warmup >= decay:  # megatron's scheduler asserts lr_warmup_steps < lr_decay_steps
        raise ValueError(f"{section}.optim: {warmup} warm-up steps must be fewer than the {decay} decay steps "
                         "(lr_decay_steps, else total_training_steps)")
    lr = optim_cfg.lr
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=optim_cfg.final_lr(),
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay,
        wd_incr_steps=decay,  # any length: the weight decay is constant
        wd_incr_style="constant",
    )
