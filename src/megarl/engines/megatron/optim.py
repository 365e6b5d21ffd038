"""megatron DDP, optimizer and learning-rate schedule of a trainable role, from its config.

Gradients are reduced in float32 buckets by megatron's DDP (averaged over data-parallel ranks);
the optimizer is megatron's (Adam with decoupled weight decay, none on biases and norms, gradient
clipping; float32 main weights under bf16/fp16; optionally the distributed optimizer) and the
schedule is megatron's `OptimizerParamScheduler` (linear warm-up, then constant, linear or cosine
decay to `lr * min_lr_ratio`).

The schedule counts *updates* (calls of `update_policy` / `update_critic`, i.e. RL steps), as
`optim.total_training_steps` does: update k (k = 1, 2, ...) runs at the learning rate of
scheduler step k, so with warm-up W the first update uses lr / W (never a zero learning rate).
"""
from __future__ import annotations

import torch

ADAM_EPS = 1e-8
DECAY_STYLES = {"constant": "constant", "cosine": "cosine", "linear": "linear"}


def wrap_ddp(chunks: list, config, use_distributed_optimizer: bool) -> list:
    """Wrap each model chunk in megatron's DistributedDataParallel and hook the pipeline schedule
    to it (`no_sync_func`, `finalize_model_grads_func`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
    )
    wrapped = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=v > 0) for v, chunk in enumerate(chunks)
    ]
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(ddp_chunks: list, optim_cfg, params_dtype: torch.dtype, use_distributed_optimizer: bool, config):
    """megatron's optimizer over the DDP-wrapped chunks, from an `OptimConfig`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if len(optim_cfg.betas) != 2:
        raise ValueError(f"optim.betas must hold two numbers, got {optim_cfg.betas}")
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=optim_cfg.optimizer,
            lr=optim_cfg.lr,
            min_lr=optim_cfg.lr * optim_cfg.min_lr_ratio,
            weight_decay=optim_cfg.weight_decay,
            adam_beta1=optim_cfg.betas[0],
            adam_beta2=optim_cfg.betas[1],
            adam_eps=ADAM_EPS,
            clip_grad=optim_cfg.clip_grad,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            params_dtype=params_dtype,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        ddp_chunks,
    )
    if params_dtype == torch.float16:
        config.grad_scale_func = optimizer.scale_loss  # dynamic loss scaling
    return optimizer


def build_scheduler(optimizer, optim_cfg, section: str):
    """megatron's `OptimizerParamScheduler` for an `OptimConfig` (`section` names it in errors)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total = optim_cfg.total_training_steps
    style = DECAY_STYLES[optim_cfg.warmup_style]
    if optim_cfg.lr_warmup_steps >= 0:
        warmup = optim_cfg.lr_warmup_steps
    elif optim_cfg.lr_warmup_steps_ratio > 0:
        if total <= 0:
            raise ValueError(
                f"{section}.optim.lr_warmup_steps_ratio={optim_cfg.lr_warmup_steps_ratio} needs "
                f"{section}.optim.total_training_steps (-1 was not filled in by the trainer)"
            )
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total)
    else:
        warmup = 0
    if total <= 0:
        if style != "constant":
            raise ValueError(
                f"{section}.optim.warmup_style={optim_cfg.warmup_style} decays the learning rate over "
                f"{section}.optim.total_training_steps, which is {total} (not filled in by the trainer)"
            )
        total = max(warmup + 1, 1)  # constant after warm-up: the decay length is never reached
    if warmup >= total:
        raise ValueError(f"{section}.optim: {warmup} warm-up steps must be fewer than total_training_steps={total}")
    lr = optim_cfg.lr
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=lr * optim_cfg.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=total,
        lr_decay_style=style,
        start_wd=optim_cfg.weight_decay,
        end_wd=optim_cfg.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
