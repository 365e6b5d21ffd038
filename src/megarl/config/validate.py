"""Semantic checks of a loaded config, run before anything heavy starts.

`resolve(config)` fills the keys whose default is "same as another key" (None in the schema).
`validate(config)` raises one ConfigError listing every problem, each naming its key path; the
batch-size checks state their units (prompts or responses) and the data-parallel size used.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from megarl.config.errors import ConfigError
from megarl.config.schema import ExperimentConfig, MegatronConfig

log = logging.getLogger("megarl.config")

LOGGERS = ("console", "tensorboard", "wandb")
# Estimators whose baseline comes from the other responses of the same prompt.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


def resolve(config: ExperimentConfig) -> ExperimentConfig:
    """Return a copy with every 'None means same as ...' key filled in."""
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
        # make its step-0 log-probs equal the actor's exactly
        megatron=arr.actor.megatron if arr.ref.megatron == MegatronConfig() else arr.ref.megatron,
    )
    rollout = replace(
        arr.rollout,
        prompt_length=arr.rollout.prompt_length or config.data.max_prompt_length,
        response_length=arr.rollout.response_length or config.data.max_response_length,
        log_prob_micro_batch_size_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu or micro,
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
    return replace(
        config,
        actor_rollout_ref=replace(arr, actor=actor, ref=ref, rollout=rollout),
        critic=critic,
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


def _model_parallel(m: MegatronConfig) -> int:
    return m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size


def batch_plan(config: ExperimentConfig) -> BatchPlan:
    """The step's derived sizes. Call only on a config that passed validate()."""
    t, arr = config.trainer, config.actor_rollout_ref
    total = t.nnodes * t.n_gpus_per_node
    split = config.placement.mode == "split"
    rollout_gpus = config.placement.rollout_gpus if split else total
    train_gpus = total - config.placement.rollout_gpus if split else total
    dp = train_gpus // _model_parallel(arr.actor.megatron)
    responses = config.data.train_batch_size * arr.rollout.n
    mini = arr.actor.ppo_mini_batch_size * arr.rollout.n
    return BatchPlan(
        total_gpus=total,
        train_gpus=train_gpus,
        rollout_gpus=rollout_gpus,
        rollout_servers=rollout_gpus // arr.rollout.tensor_model_parallel_size,
        actor_dp=dp,
        responses_per_step=responses,
        actor_mini_batches_per_epoch=responses // mini,
        actor_responses_per_mini_batch_per_rank=mini // dp,
    )


def _check_positive(errors: list, path: str, value, allow_minus_one: bool = False) -> None:
    if value is None:
        return
    if allow_minus_one and value == -1:
        return
    if value <= 0:
        extra = " or -1 (never)" if allow_minus_one else ""
        errors.append(f"{path}={value}: must be a positive integer{extra}")


def _check_range(errors: list, path: str, value, low: float, high: float, low_open: bool = False) -> None:
    if value is None:
        return
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        errors.append(f"{path}={value}: must be in {bracket}{low}, {high}]")


def _check_megatron(errors: list, prefix: str, m: MegatronConfig, train_gpus: int, gpus_per_node: int) -> int:
    """Check one role's parallel sizes; return its data-parallel size (0 if invalid)."""
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        _check_positive(errors, f"{prefix}.{key}", getattr(m, key))
    if min(tp, pp, m.context_parallel_size) <= 0:
        return 0
    if m.virtual_pipeline_model_parallel_size is not None:
        if pp == 1:
            errors.append(
                f"{prefix}.virtual_pipeline_model_parallel_size={m.virtual_pipeline_model_parallel_size}: "
                f"needs {prefix}.pipeline_model_parallel_size > 1 (or set it to null)"
            )
        _check_positive(errors, f"{prefix}.virtual_pipeline_model_parallel_size", m.virtual_pipeline_model_parallel_size)
    if gpus_per_node % tp:
        errors.append(
            f"{prefix}.tensor_model_parallel_size={tp}: a TP group must stay inside one node, so it must divide "
            f"trainer.n_gpus_per_node={gpus_per_node} (try {_largest_divisor_at_most(gpus_per_node, tp)})"
        )
        return 0
    mp = _model_parallel(m)
    if train_gpus % mp:
        errors.append(
            f"{prefix}: TP x PP x CP = {tp} x {pp} x {m.context_parallel_size} = {mp} GPUs per model replica "
            f"does not divide the {train_gpus} training GPUs; change the parallel sizes or the GPU count"
        )
        return 0
    return train_gpus // mp


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _check_batches(errors: list, role: str, mini_key: str, mini: int, micro_key: str, micro, dynamic: bool,
                   train_batch: int, n: int, dp: int) -> None:
    """Check that prompts -> responses -> mini-batches -> DP ranks -> micro-batches all divide."""
    responses = train_batch * n
    if mini > train_batch:
        errors.append(
            f"{mini_key}={mini} prompts is larger than data.train_batch_size={train_batch} prompts per step"
        )
        return
    if train_batch % mini:
        errors.append(
            f"{mini_key}={mini} prompts must divide data.train_batch_size={train_batch} prompts "
            f"(each step is cut into whole mini-batches)"
        )
        return
    mini_responses = mini * n
    if responses % dp:
        errors.append(
            f"data.train_batch_size={train_batch} prompts x actor_rollout_ref.rollout.n={n} = {responses} responses "
            f"cannot be split evenly over the {role} data-parallel size {dp}"
        )
        return
    if mini_responses % dp:
        errors.append(
            f"{mini_key}={mini} prompts x actor_rollout_ref.rollout.n={n} = {mini_responses} responses per mini-batch "
            f"cannot be split evenly over the {role} data-parallel size {dp}"
        )
        return
    per_rank = mini_responses // dp
    if micro is not None and not dynamic and micro > 0 and per_rank % micro:
        errors.append(
            f"{micro_key}={micro} responses must divide the {per_rank} responses each {role} data-parallel rank "
            f"gets per mini-batch ({mini} prompts x {n} / DP {dp})"
        )


def validate(config: ExperimentConfig) -> ExperimentConfig:
    """Resolve derived defaults and check the whole config; raise ConfigError listing every problem."""
    config = resolve(config)
    errors: list[str] = []
    a, d, t, p = config.algorithm, config.data, config.trainer, config.placement
    arr = config.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout

    # Required keys
    if not arr.model.path:
        errors.append("actor_rollout_ref.model.path: required (an HF checkpoint directory)")
    if not d.train_files:
        errors.append("data.train_files: required (one or more parquet files)")

    # Plain ranges
    for path, value in [
        ("data.train_batch_size", d.train_batch_size),
        ("data.val_batch_size", d.val_batch_size),
        ("data.gen_batch_size", d.gen_batch_size),
        ("reward_model.max_length", config.reward_model.max_length),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu),
        ("actor_rollout_ref.rollout.n", rollout.n),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout.tensor_model_parallel_size),
        ("actor_rollout_ref.rollout.max_concurrent_requests", rollout.max_concurrent_requests),
        ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", rollout.update_weights_bucket_megabytes),
        ("trainer.nnodes", t.nnodes),
        ("trainer.n_gpus_per_node", t.n_gpus_per_node),
        ("trainer.total_epochs", t.total_epochs),
        ("trainer.total_training_steps", t.total_training_steps),
    ]:
        _check_positive(errors, path, value)
    _check_positive(errors, "trainer.test_freq", t.test_freq, allow_minus_one=True)
    _check_positive(errors, "trainer.save_freq", t.save_freq, allow_minus_one=True)
    _check_range(errors, "algorithm.gamma", a.gamma, 0.0, 1.0)
    _check_range(errors, "algorithm.lam", a.lam, 0.0, 1.0)
    _check_range(errors, "actor_rollout_ref.rollout.top_p", rollout.top_p, 0.0, 1.0, low_open=True)
    _check_range(errors, "actor_rollout_ref.rollout.gpu_memory_utilization", rollout.gpu_memory_utilization,
                 0.0, 1.0, low_open=True)
    if rollout.temperature < 0:
        errors.append(f"actor_rollout_ref.rollout.temperature={rollout.temperature}: must be >= 0")
    if rollout.top_k != -1 and rollout.top_k <= 0:
        errors.append(f"actor_rollout_ref.rollout.top_k={rollout.top_k}: must be a positive integer or -1 (off)")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        if getattr(actor, key) <= 0:
            errors.append(f"actor_rollout_ref.actor.{key}={getattr(actor, key)}: must be > 0")
    if actor.clip_ratio_c <= 1:
        errors.append(f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c}: the dual-clip bound must be > 1")
    if p.gpu_memory_gib <= 0:
        errors.append(f"placement.gpu_memory_gib={p.gpu_memory_gib}: must be > 0")
    if actor.optim.lr <= 0:
        errors.append(f"actor_rollout_ref.actor.optim.lr={actor.optim.lr}: must be > 0")
    if a.kl_ctrl.kl_coef < 0:
        errors.append(f"algorithm.kl_ctrl.kl_coef={a.kl_ctrl.kl_coef}: must be >= 0")
    for logger in t.logger:
        if logger not in LOGGERS:
            errors.append(f"trainer.logger: unknown logger {logger!r}; choose from {list(LOGGERS)}")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        errors.append("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N directory)")
    if actor.use_dynamic_bsz and actor.ppo_max_token_len_per_gpu < d.max_prompt_length + d.max_response_length:
        errors.append(
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu} tokens is less than "
            f"one full sequence (data.max_prompt_length + data.max_response_length = "
            f"{d.max_prompt_length + d.max_response_length} tokens)"
        )

    # Algorithm choices that need other keys
    if a.adv_estimator in GROUP_ESTIMATORS and rollout.n < 2:
        log.warning(
            "algorithm.adv_estimator=%s compares responses to the same prompt, but actor_rollout_ref.rollout.n=%d: "
            "every group has one response and every advantage will be 0; set rollout.n >= 2 to learn",
            a.adv_estimator, rollout.n,
        )
    if a.adv_estimator == "gae" and not config.critic.enable:
        errors.append("algorithm.adv_estimator=gae needs a critic: remove critic.enable=false or pick another estimator")
    rm_length = config.reward_model.max_length
    if config.reward_model.enable and rm_length is not None and rm_length < d.max_prompt_length + d.max_response_length:
        errors.append(
            f"reward_model.max_length={rm_length} tokens is less than a whole sequence (data.max_prompt_length + "
            f"data.max_response_length = {d.max_prompt_length + d.max_response_length} tokens): the reward model "
            "scores prompt and response as the policy produced them and never truncates; raise it or leave it unset"
        )
    if a.filter_groups.enable and rollout.n < 2:
        errors.append("algorithm.filter_groups.enable=true drops groups of equal rewards: needs actor_rollout_ref.rollout.n >= 2")
    if actor.tis_imp_ratio_cap != -1 and actor.tis_imp_ratio_cap < 1:
        errors.append(f"actor_rollout_ref.actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap}: must be -1 (off) or >= 1 "
                      "(the largest weight a token's loss may get)")
    if d.gen_batch_size not in (None, d.train_batch_size) and not a.filter_groups.enable:
        errors.append(
            f"data.gen_batch_size={d.gen_batch_size} differs from data.train_batch_size={d.train_batch_size}, which "
            "only DAPO's dynamic sampling uses: set algorithm.filter_groups.enable=true, or remove data.gen_batch_size"
        )
    for section, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", config.critic.optim)):
        needs_total = optim.lr_warmup_steps < 0 and optim.lr_warmup_steps_ratio > 0 or optim.warmup_style != "constant"
        if needs_total and optim.total_training_steps <= 0 and not t.total_training_steps:
            errors.append(f"{section}: lr_warmup_steps_ratio / warmup_style={optim.warmup_style} need the number of "
                          f"steps: set trainer.total_training_steps (or {section}.total_training_steps)")
    if a.dpo.beta <= 0:
        errors.append(f"algorithm.dpo.beta={a.dpo.beta}: must be > 0")
    if not 0 <= a.dpo.label_smoothing < 0.5:
        errors.append(f"algorithm.dpo.label_smoothing={a.dpo.label_smoothing}: must be in [0, 0.5)")
    if config.custom_reward_function.timeout_s <= 0:
        errors.append(f"custom_reward_function.timeout_s={config.custom_reward_function.timeout_s}: must be > 0 seconds")
    if rollout.max_server_restarts < 0:
        errors.append(f"actor_rollout_ref.rollout.max_server_restarts={rollout.max_server_restarts}: must be >= 0")
    if t.max_consecutive_skipped_steps < 1:
        errors.append(f"trainer.max_consecutive_skipped_steps={t.max_consecutive_skipped_steps}: must be >= 1")
    agent = rollout.agent
    for key in ("max_turns", "max_tokens_per_episode", "max_concurrent_episodes"):
        _check_positive(errors, f"actor_rollout_ref.rollout.agent.{key}", getattr(agent, key))
    if agent.episode_timeout_s <= 0:
        errors.append(f"actor_rollout_ref.rollout.agent.episode_timeout_s={agent.episode_timeout_s}: must be > 0 seconds")
    if agent.judge.url and not agent.judge.url.startswith(("http://", "https://")):
        errors.append(f"actor_rollout_ref.rollout.agent.judge.url={agent.judge.url!r}: must be an http(s) URL")
    if agent.judge.api_key_env and agent.judge.url and agent.judge.api_key_env not in os.environ:
        errors.append(f"actor_rollout_ref.rollout.agent.judge.api_key_env={agent.judge.api_key_env}: "
                      "that environment variable is not set")
    _check_positive(errors, "actor_rollout_ref.rollout.agent.judge.max_tokens", agent.judge.max_tokens)
    if not 0 <= agent.port <= 65535:
        errors.append(f"actor_rollout_ref.rollout.agent.port={agent.port}: must be a TCP port (0: a free one)")
    if config.reward_model.add_rule_reward and not config.reward_model.enable:
        errors.append("reward_model.add_rule_reward=true adds the rule reward to a reward model's score: "
                      "set reward_model.enable=true too, or drop it")
    if config.reward_model.enable and not config.reward_model.model.path:
        errors.append("reward_model.enable=true needs reward_model.model.path")
    if rollout.name == "sglang" and t.device == "cpu":
        errors.append("actor_rollout_ref.rollout.name=sglang needs GPUs; with trainer.device=cpu use rollout.name=cpu")

    # Placement and parallel sizes
    total = t.nnodes * t.n_gpus_per_node if t.nnodes > 0 and t.n_gpus_per_node > 0 else 0
    train_gpus = total
    if total:
        if p.mode == "split":
            if not 0 < p.rollout_gpus < total:
                errors.append(
                    f"placement.rollout_gpus={p.rollout_gpus}: with placement.mode=split it must leave GPUs for both "
                    f"pools (1 .. {total - 1} of the {total} GPUs)"
                )
                train_gpus = 0
            else:
                train_gpus = total - p.rollout_gpus
        elif p.rollout_gpus:
            errors.append(
                f"placement.rollout_gpus={p.rollout_gpus} is used only with placement.mode=split "
                f"(colocate shares all GPUs)"
            )
        rollout_pool = p.rollout_gpus if p.mode == "split" else total
        rtp = rollout.tensor_model_parallel_size
        if rtp > 0 and (t.n_gpus_per_node % rtp or (rollout_pool and rollout_pool % rtp)):
            errors.append(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp}: a rollout server stays inside one node, "
                f"so it must divide trainer.n_gpus_per_node={t.n_gpus_per_node} and the {rollout_pool} rollout GPUs"
            )
    if train_gpus:
        dp = _check_megatron(errors, "actor_rollout_ref.actor.megatron", actor.megatron, train_gpus, t.n_gpus_per_node)
        _check_megatron(errors, "actor_rollout_ref.ref.megatron", arr.ref.megatron, train_gpus, t.n_gpus_per_node)
        if dp and d.train_batch_size > 0 and actor.ppo_mini_batch_size > 0 and rollout.n > 0:
            _check_batches(errors, "actor", "actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size,
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu,
                           actor.use_dynamic_bsz, d.train_batch_size, rollout.n, dp)
        if config.critic.enable:
            cdp = _check_megatron(errors, "critic.megatron", config.critic.megatron, train_gpus, t.n_gpus_per_node)
            _check_positive(errors, "critic.ppo_mini_batch_size", config.critic.ppo_mini_batch_size)
            if cdp and d.train_batch_size > 0 and config.critic.ppo_mini_batch_size > 0 and rollout.n > 0:
                _check_batches(errors, "critic", "critic.ppo_mini_batch_size", config.critic.ppo_mini_batch_size,
                               "critic.ppo_micro_batch_size_per_gpu", config.critic.ppo_micro_batch_size_per_gpu,
                               config.critic.use_dynamic_bsz, d.train_batch_size, rollout.n, cdp)
        if config.reward_model.enable:
            _check_megatron(errors, "reward_model.megatron", config.reward_model.megatron, train_gpus, t.n_gpus_per_node)

    if errors:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {e}" for e in errors))
    return config
