"""Semantic checks of a loaded config, run before anything heavy starts.

`resolve(config)` fills the keys whose default is "same as another key" (None in the schema).
`validate(config)` runs every rule of megarl.config.rules and raises one ConfigError listing every
problem, each naming its key path; the batch-size checks state their units (prompts or responses)
and the data-parallel size used.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from megarl.config.errors import ConfigError
from megarl.config.rules import RULES, UNRESOLVED_WARNING_RULES, WARNING_RULES, DerivedSizes
from megarl.config.rules.choices import deterministic_inference_default, lr_schedule_has_step_count
from megarl.config.schema import ExperimentConfig, MegatronConfig


# megatron-core TransformerConfig fields that are also megarl keys of `<role>.megatron` (verl sets them only in
# override_transformer_config): an override's value is taken as megarl's key while that key is at its default
MOVED_OVERRIDES = ("moe_grouped_gemm", "moe_aux_loss_coeff", "moe_z_loss_coeff", "sequence_parallel")


def _own_keys(megatron: MegatronConfig) -> MegatronConfig:
    """`megatron` with the MOVED_OVERRIDES of its override_transformer_config in megarl's keys of the same
    name where those are at their defaults (so that `config show` prints each once); a differing value
    set both ways stays, for the rule that refuses it."""
    overrides, defaults, moved = dict(megatron.override_transformer_config), MegatronConfig(), {}
    for name in MOVED_OVERRIDES:
        if name in overrides and getattr(megatron, name) == getattr(defaults, name):
            moved[name] = overrides.pop(name)
    return replace(megatron, override_transformer_config=overrides, **moved) if moved else megatron


def resolve(config: ExperimentConfig) -> ExperimentConfig:
    """Return a copy with every 'None means same as ...' key filled in."""
    config = replace(
        config,
        actor_rollout_ref=replace(
            config.actor_rollout_ref,
            actor=replace(config.actor_rollout_ref.actor, megatron=_own_keys(config.actor_rollout_ref.actor.megatron)),
            ref=replace(config.actor_rollout_ref.ref, megatron=_own_keys(config.actor_rollout_ref.ref.megatron))),
        critic=replace(config.critic, megatron=_own_keys(config.critic.megatron)),
        reward_model=replace(config.reward_model, megatron=_own_keys(config.reward_model.megatron)),
    )
    arr = config.actor_rollout_ref
    steps = config.trainer.total_training_steps

    def with_total(optim):  # optim.total_training_steps=-1: the trainer's step count (optimizer steps' schedule)
        return optim if optim.total_training_steps > 0 or not steps else replace(optim, total_training_steps=steps)

    actor = replace(
        arr.actor,
        clip_ratio_low=arr.actor.clip_ratio if arr.actor.clip_ratio_low is None else arr.actor.clip_ratio_low,
        clip_ratio_high=arr.actor.clip_ratio if arr.actor.clip_ratio_high is None else arr.actor.clip_ratio_high,
        optim=with_total(arr.actor.optim),
    )
    micro = arr.actor.ppo_micro_batch_size_per_gpu
    ref = replace(
        arr.ref,
        log_prob_micro_batch_size_per_gpu=arr.ref.log_prob_micro_batch_size_per_gpu or micro,
        # a reference left at the defaults takes the actor's layout: the same shards and micro-batches
        # make its step-0 log-probs equal the actor's exactly; its transformer overrides are the actor's
        # unless it has its own (verl's ref.megatron.override_transformer_config default)
        megatron=arr.actor.megatron if arr.ref.megatron == MegatronConfig() else replace(
            arr.ref.megatron, override_transformer_config=(arr.ref.megatron.override_transformer_config
                                                           or arr.actor.megatron.override_transformer_config)),
    )
    rollout = replace(
        arr.rollout,
        prompt_length=arr.rollout.prompt_length or config.data.max_prompt_length,
        response_length=arr.rollout.response_length or config.data.max_response_length,
        log_prob_micro_batch_size_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu or micro,
        log_prob_use_dynamic_bsz=(arr.actor.use_dynamic_bsz if arr.rollout.log_prob_use_dynamic_bsz is None
                                  else arr.rollout.log_prob_use_dynamic_bsz),
        log_prob_max_token_len_per_gpu=(arr.actor.ppo_max_token_len_per_gpu
                                        if arr.rollout.log_prob_max_token_len_per_gpu is None
                                        else arr.rollout.log_prob_max_token_len_per_gpu),
        deterministic_inference=(deterministic_inference_default(config.trainer.resume_mode, arr.rollout.name,
                                                                 config.trainer.device)
                                 if arr.rollout.deterministic_inference is None
                                 else arr.rollout.deterministic_inference),
    )
    critic = config.critic
    critic = replace(
        critic,
        enable=(config.algorithm.adv_estimator == "gae") if critic.enable is None else critic.enable,
        ppo_mini_batch_size=critic.ppo_mini_batch_size or arr.actor.ppo_mini_batch_size,
        ppo_micro_batch_size_per_gpu=critic.ppo_micro_batch_size_per_gpu or micro,
        ppo_epochs=critic.ppo_epochs or arr.actor.ppo_epochs,
        model=replace(critic.model, path=critic.model.path or arr.model.path),
        optim=with_total(critic.optim),
    )
    teacher = config.distillation.teacher
    teacher = replace(teacher, log_prob_micro_batch_size_per_gpu=teacher.log_prob_micro_batch_size_per_gpu or micro)
    return replace(
        config,
        actor_rollout_ref=replace(arr, actor=actor, ref=ref, rollout=rollout),
        critic=critic,
        distillation=replace(config.distillation, teacher=teacher),
    )


@dataclass
class BatchPlan:
    """Derived sizes of one RL step. Units in the names: prompts, responses, GPUs."""

    total_gpus: int
    train_gpus: int
    rollout_gpus: int
    rollout_servers: int
    actor_dp: int
    responses_per_step: int
    actor_mini_batches_per_epoch: int
    actor_responses_per_mini_batch_per_rank: int


def batch_plan(config: ExperimentConfig) -> BatchPlan:
    """The step's derived sizes. Call only on a config that passed validate()."""
    sizes, rollout = DerivedSizes.from_config(config), config.actor_rollout_ref.rollout
    responses = config.data.train_batch_size * rollout.n
    mini = config.actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n
    return BatchPlan(
        total_gpus=sizes.total_gpus,
        train_gpus=sizes.train_gpus,
        rollout_gpus=sizes.rollout_gpus,
        rollout_servers=sizes.rollout_gpus // rollout.tensor_model_parallel_size,
        actor_dp=sizes.actor_dp,
        responses_per_step=responses,
        actor_mini_batches_per_epoch=responses // mini,
        actor_responses_per_mini_batch_per_rank=mini // sizes.actor_dp,
    )


def _rules(steps_from_data: bool) -> list:
    """RULES, without the schedule's step count where the trainer takes it from its data."""
    return [rule for rule in RULES if not (steps_from_data and rule is lr_schedule_has_step_count)]


def problems_on_resolved_device(config: ExperimentConfig, device: str, steps_from_data: bool = False) -> list[str]:
    """The rules' problems (`validate`'s) with trainer.device=auto pinned to the `device` it resolved
    to at launch ("cuda" or "cpu", megarl.runtime.devices.resolve_devices): a config validated with
    auto passed every rule that holds on one device or the other, and the rules that read
    trainer.device (SGLang on a CPU: attention DP, FP8 rollout, MTP drafting, LoRA adapters, ...)
    apply now. [] for any other trainer.device (validate checked it as given). `steps_from_data`: as
    `validate`'s."""
    if config.trainer.device != "auto":
        return []
    pinned = replace(config, trainer=replace(config.trainer, device=device))
    sizes = DerivedSizes.from_config(pinned)
    return [f"{message} (trainer.device=auto is {device} on this machine)" for rule in _rules(steps_from_data)
            for message in rule(pinned, sizes)]


def validate(config: ExperimentConfig, steps_from_data: bool = False) -> ExperimentConfig:
    """Resolve derived defaults and run every rule; raise ConfigError listing every problem.
    `steps_from_data`: the trainer fills the optimizer's step count from its data when
    trainer.total_training_steps is null (megarl's SFT, as verl's: total_epochs x batches per epoch),
    so a learning-rate schedule needs no step count here."""
    warnings = [message for rule in UNRESOLVED_WARNING_RULES for message in rule(config, None)]
    config = resolve(config)
    sizes = DerivedSizes.from_config(config)
    errors = [message for rule in _rules(steps_from_data) for message in rule(config, sizes)]
    warnings += [message for rule in WARNING_RULES for message in rule(config, sizes)]
    for message in warnings:
        logging.getLogger("megarl.config").warning("%s", message)
    if errors:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {e}" for e in errors))
    return config
