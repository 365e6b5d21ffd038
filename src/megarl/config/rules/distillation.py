"""Rules on on-policy distillation (`distillation.*`, megarl.algos.opd): the teacher's keys per
type, its place and layout, and the combinations with the RL keys that cannot work."""
from __future__ import annotations

import os
from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes, positive
from megarl.config.rules.gpus import layout_problems
from megarl.config.schema import ExperimentConfig

KEY = "distillation"
OFFLOAD_KEYS = ("param_offload", "grad_offload", "optimizer_offload")


def distillation_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """An enabled distillation names its teacher's model (both types: the tokenizer check reads
    it), a positive `kl_coef`, and the keys of its type only: `teacher.url` for sglang;
    `teacher.gpus` and `teacher.megatron` for megatron. Pure OPD (`use_task_rewards=false`) takes
    no reward-shaped advantage: not GAE's critic, not the KL penalty in the reward.

    Reads: distillation, algorithm.adv_estimator, algorithm.use_kl_in_reward
    """
    d = config.distillation
    if not d.enabled:
        return
    t = d.teacher
    if not t.model_path:
        yield (f"{KEY}.teacher.model_path: required with {KEY}.enabled=true (the teacher's HF checkpoint; "
               "with type=sglang the model its server serves, whose tokenizer must be the student's)")
    if not d.kl_coef > 0:
        yield f"{KEY}.kl_coef={d.kl_coef}: must be > 0 (the weight of the reverse KL in the advantage)"
    yield from positive(f"{KEY}.teacher.log_prob_micro_batch_size_per_gpu", t.log_prob_micro_batch_size_per_gpu)
    if d.type == "sglang":
        if not t.url:
            yield (f"{KEY}.type=sglang needs {KEY}.teacher.url: the teacher's SGLang server or router "
                   "(e.g. http://teacher-host:30000)")
        if t.gpus:
            yield (f"{KEY}.teacher.gpus={t.gpus} places a Megatron teacher; an SGLang teacher runs on its own "
                   f"server (set {KEY}.teacher.gpus=0, or {KEY}.type=megatron)")
        yield from positive(f"{KEY}.teacher.max_concurrent_requests", t.max_concurrent_requests)
        if t.request_timeout_s <= 0:
            yield f"{KEY}.teacher.request_timeout_s={t.request_timeout_s}: must be > 0"
        if t.api_key_env is not None and not os.environ.get(t.api_key_env):
            yield (f"{KEY}.teacher.api_key_env={t.api_key_env}: that environment variable is not set (or empty) "
                   "here; export it with the teacher server's --api-key, or leave the key unset for a server "
                   "without one")
    else:
        for key in ("url", "api_key_env"):
            if getattr(t, key):
                yield (f"{KEY}.teacher.{key}={getattr(t, key)!r} is for {KEY}.type=sglang; a Megatron teacher runs "
                       f"on the training GPUs (remove it, or set {KEY}.type=sglang)")
    yield from distillation_loss_problems(config)
    if not d.use_task_rewards:
        pure = f"{KEY}.use_task_rewards=false (pure OPD: the advantage is the teacher's signal alone)"
        if config.algorithm.adv_estimator == "gae":
            yield (f"{pure} leaves nothing for algorithm.adv_estimator=gae's critic to do; pick a critic-free "
                   "estimator (e.g. grpo) or set use_task_rewards=true")
        if config.algorithm.use_kl_in_reward:
            yield (f"{pure} ignores the rewards, so algorithm.use_kl_in_reward=true would do nothing; use "
                   "actor_rollout_ref.actor.use_kl_loss for a reference KL, or set use_task_rewards=true")


def distillation_loss_problems(config: ExperimentConfig) -> Iterator[str]:
    """The distillation loss (`loss_mode`, megarl.algos.opd) as verl allows it: k1 only through the
    policy gradient (verl's `DistillationLossConfig.__post_init__`: its gradient does not depend on
    the teacher); a positive `topk` and `loss_max_clamp`.

    Reads: distillation.loss_mode, distillation.use_policy_gradient, distillation.topk,
    distillation.loss_max_clamp
    """
    d = config.distillation
    if d.loss_mode in ("k1", "kl") and not d.use_policy_gradient:
        yield (f"{KEY}.loss_mode={d.loss_mode} with {KEY}.use_policy_gradient=false: the gradient of the k1 loss "
               "does not depend on the teacher (verl refuses it too, DistillationLossConfig); use k3 or "
               "forward_kl_topk, or use_policy_gradient=true")
    if d.loss_mode == "forward_kl_topk":
        if d.topk < 1:
            yield f"{KEY}.topk={d.topk}: must be >= 1 (the teacher's tokens per position)"
    if d.loss_max_clamp is not None and not d.loss_max_clamp > 0:
        yield f"{KEY}.loss_max_clamp={d.loss_max_clamp}: must be > 0 (the loss is clamped to [-c, c]) or null"


def distillation_teacher_fits(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A Megatron teacher's pool: its own `teacher.gpus` leave GPUs for the other pools, and its
    TP x PP x CP fits the nodes and divides its pool (the training GPUs when it shares them).
    Offload keys only where the teacher shares the colocated pool (megarl.placement.colocation:
    parameters only, as the reference).

    Reads: distillation, placement.mode, placement.rollout_gpus, trainer.nnodes, trainer.n_gpus_per_node
    """
    d = config.distillation
    if not d.enabled or d.type != "megatron" or not sizes.total_gpus:
        return
    t, p, prefix = d.teacher, config.placement, f"{KEY}.teacher.megatron"
    others = p.rollout_gpus if p.mode == "split" else 0
    if t.gpus < 0 or t.gpus >= sizes.total_gpus - others:
        yield (f"{KEY}.teacher.gpus={t.gpus}: must be 0 (the training pool) or leave GPUs for the other pools "
               f"(1 .. {sizes.total_gpus - others - 1} of the {sizes.total_gpus} GPUs"
               + (f", {others} of them for placement.rollout_gpus)" if others else ")"))
        return
    pool = t.gpus or sizes.train_gpus
    if pool:
        yield from layout_problems(prefix, t.megatron, pool, config.trainer.n_gpus_per_node)
    offload = [f"{prefix}.{k}" for k in OFFLOAD_KEYS if getattr(t.megatron, k)]
    trains_nothing = [k for k in offload if not k.endswith("param_offload")]
    if trains_nothing:
        yield f"{', '.join(trains_nothing)}: the teacher has no gradients or optimizer state; set them to false"
    if f"{prefix}.param_offload" in offload and (p.mode != "colocate" or t.gpus):
        where = "its own pool" if t.gpus else "split placement's training pool"
        yield (f"{prefix}.param_offload=true: the teacher on {where} shares no GPU with the rollout servers, so "
               "offloading frees nothing; set it to false")
