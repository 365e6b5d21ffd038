"""Rules on one key, or one small group, at a time: required keys, positive counts, ranges, names
from a fixed list, the fault limits, the agent's settings."""
from __future__ import annotations

import os
from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes, in_range, positive
from megarl.config.schema import ExperimentConfig

LOGGERS = ("console", "tensorboard", "wandb")
SOURCE_PREFIXES = ("reasoning_gym:",)  # data.source: megarl.data.reasoning_gym.SPEC_PREFIX


def required_keys(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The model and the training data must be given: train_files, or a source that writes them.

    Reads: actor_rollout_ref.model.path, data.train_files, data.val_files, data.source
    """
    d = config.data
    if not config.actor_rollout_ref.model.path:
        yield "actor_rollout_ref.model.path: required (an HF checkpoint directory)"
    if d.source is None and not d.train_files:
        yield "data.train_files: required (one or more parquet files), or data.source"
    if d.source is not None and (d.train_files or d.val_files):
        yield (f"data.source={d.source!r} writes the train and val files: leave data.train_files and "
               "data.val_files unset")
    if d.source is not None and not d.source.startswith(SOURCE_PREFIXES):
        yield f"data.source={d.source!r}: give {' or '.join(p + '<task>' for p in SOURCE_PREFIXES)}"


def positive_counts(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Counts and sizes must be positive integers (the frequencies may be -1: never).

    Reads: data.train_batch_size, data.val_batch_size, data.gen_batch_size, reward_model.max_length,
    data.max_prompt_length, data.max_response_length, actor_rollout_ref.actor.ppo_mini_batch_size,
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, actor_rollout_ref.actor.ppo_epochs,
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu, actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu,
    actor_rollout_ref.rollout.n,
    actor_rollout_ref.rollout.tensor_model_parallel_size, actor_rollout_ref.rollout.expert_parallel_size,
    actor_rollout_ref.rollout.attention_data_parallel_size,
    actor_rollout_ref.rollout.max_concurrent_requests,
    actor_rollout_ref.rollout.update_weights_bucket_megabytes, trainer.nnodes, trainer.n_gpus_per_node,
    trainer.total_epochs, trainer.total_training_steps, trainer.test_freq, trainer.save_freq,
    data.source_train_size, data.source_val_size
    """
    d, t = config.data, config.trainer
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    for path, value in [
        ("data.train_batch_size", d.train_batch_size),
        ("data.val_batch_size", d.val_batch_size),
        ("data.gen_batch_size", d.gen_batch_size),
        ("reward_model.max_length", config.reward_model.max_length),
        ("data.max_prompt_length", d.max_prompt_length),
        ("data.max_response_length", d.max_response_length),
        ("data.source_train_size", d.source_train_size),
        ("data.source_val_size", d.source_val_size),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu),
        ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu),
        ("actor_rollout_ref.rollout.n", rollout.n),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout.tensor_model_parallel_size),
        ("actor_rollout_ref.rollout.expert_parallel_size", rollout.expert_parallel_size),
        ("actor_rollout_ref.rollout.attention_data_parallel_size", rollout.attention_data_parallel_size),
        ("actor_rollout_ref.rollout.max_concurrent_requests", rollout.max_concurrent_requests),
        ("actor_rollout_ref.rollout.update_weights_bucket_megabytes", rollout.update_weights_bucket_megabytes),
        ("trainer.nnodes", t.nnodes),
        ("trainer.n_gpus_per_node", t.n_gpus_per_node),
        ("trainer.total_epochs", t.total_epochs),
        ("trainer.total_training_steps", t.total_training_steps),
    ]:
        yield from positive(path, value)
    yield from positive("trainer.test_freq", t.test_freq, allow_minus_one=True)
    yield from positive("trainer.save_freq", t.save_freq, allow_minus_one=True)


def value_ranges(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Numbers that must lie in a range on their own.

    Reads: algorithm.gamma, algorithm.lam, actor_rollout_ref.rollout.top_p,
    actor_rollout_ref.rollout.gpu_memory_utilization, actor_rollout_ref.rollout.temperature,
    actor_rollout_ref.rollout.top_k, actor_rollout_ref.actor.clip_ratio, actor_rollout_ref.actor.clip_ratio_low,
    actor_rollout_ref.actor.clip_ratio_high, actor_rollout_ref.actor.clip_ratio_c, placement.gpu_memory_gib,
    actor_rollout_ref.actor.optim.lr, algorithm.kl_ctrl.kl_coef
    """
    a, p = config.algorithm, config.placement
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    yield from in_range("algorithm.gamma", a.gamma, 0.0, 1.0)
    yield from in_range("algorithm.lam", a.lam, 0.0, 1.0)
    yield from in_range("actor_rollout_ref.rollout.top_p", rollout.top_p, 0.0, 1.0, low_open=True)
    yield from in_range("actor_rollout_ref.rollout.gpu_memory_utilization", rollout.gpu_memory_utilization,
                         0.0, 1.0, low_open=True)
    if rollout.temperature < 0:
        yield f"actor_rollout_ref.rollout.temperature={rollout.temperature}: must be >= 0"
    if rollout.top_k != -1 and rollout.top_k <= 0:
        yield f"actor_rollout_ref.rollout.top_k={rollout.top_k}: must be a positive integer or -1 (off)"
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        if getattr(actor, key) <= 0:
            yield f"actor_rollout_ref.actor.{key}={getattr(actor, key)}: must be > 0"
    if actor.clip_ratio_c <= 1:
        yield f"actor_rollout_ref.actor.clip_ratio_c={actor.clip_ratio_c}: the dual-clip bound must be > 1"
    if p.gpu_memory_gib <= 0:
        yield f"placement.gpu_memory_gib={p.gpu_memory_gib}: must be > 0"
    if actor.optim.lr <= 0:
        yield f"actor_rollout_ref.actor.optim.lr={actor.optim.lr}: must be > 0"
    if a.kl_ctrl.kl_coef < 0:
        yield f"algorithm.kl_ctrl.kl_coef={a.kl_ctrl.kl_coef}: must be >= 0"


def known_loggers(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Every logger named must be one megarl has.

    Reads: trainer.logger
    """
    for logger in config.trainer.logger:
        if logger not in LOGGERS:
            yield f"trainer.logger: unknown logger {logger!r}; choose from {list(LOGGERS)}"


def resume_path_given(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Resuming from a path needs the path.

    Reads: trainer.resume_mode, trainer.resume_from_path
    """
    t = config.trainer
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        yield "trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N directory)"


def dist_checkpoint_given(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """verl's initial weights from a distributed checkpoint need its directory, and only the actor and
    the reference take them (the critic's and reward model's are built from HF checkpoints).

    Reads: actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron, critic.megatron,
    reward_model.megatron
    """
    for section, megatron in (("actor_rollout_ref.actor", config.actor_rollout_ref.actor.megatron),
                              ("actor_rollout_ref.ref", config.actor_rollout_ref.ref.megatron)):
        if megatron.use_dist_checkpointing and not megatron.dist_checkpointing_path:
            yield (f"{section}.megatron.use_dist_checkpointing=true needs {section}.megatron.dist_checkpointing_path "
                   "(the directory megatron-core's dist_checkpointing.save wrote, e.g. by verl's "
                   "scripts/converter_hf_to_mcore.py)")
    for section, megatron in (("critic", config.critic.megatron), ("reward_model", config.reward_model.megatron)):
        if megatron.use_dist_checkpointing:
            yield (f"{section}.megatron.use_dist_checkpointing=true: megarl builds the {section} from its HF "
                   "checkpoint (model.path); only the actor and the reference load a distributed checkpoint")


def importance_cap_range(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The truncated importance-sampling cap is off (-1) or at least 1.

    Reads: actor_rollout_ref.actor.tis_imp_ratio_cap
    """
    cap = config.actor_rollout_ref.actor.tis_imp_ratio_cap
    if cap != -1 and cap < 1:
        yield (f"actor_rollout_ref.actor.tis_imp_ratio_cap={cap}: must be -1 (off) or >= 1 "
               "(the largest weight a token's loss may get)")


def rollout_log_probs_without_tis(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """With the rollout's log-probs as the old ones, truncated importance sampling would weigh every
    token by exp(rollout - rollout) = 1: a correction that does nothing, so the pair is refused.

    Reads: actor_rollout_ref.actor.use_rollout_log_probs, actor_rollout_ref.actor.tis_imp_ratio_cap
    """
    actor = config.actor_rollout_ref.actor
    if actor.use_rollout_log_probs and actor.tis_imp_ratio_cap > 0:
        yield (f"actor_rollout_ref.actor.use_rollout_log_probs=true makes the PPO ratio the importance weight "
               f"to the rollout already: actor_rollout_ref.actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap} "
               "would weigh every token by 1; set it to -1")


def dpo_ranges(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """DPO's beta is positive and its label smoothing in [0, 0.5).

    Reads: algorithm.dpo.beta, algorithm.dpo.label_smoothing
    """
    dpo = config.algorithm.dpo
    if dpo.beta <= 0:
        yield f"algorithm.dpo.beta={dpo.beta}: must be > 0"
    if not 0 <= dpo.label_smoothing < 0.5:
        yield f"algorithm.dpo.label_smoothing={dpo.label_smoothing}: must be in [0, 0.5)"


def fault_limits(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The limits on slow rewards, dead servers, skipped steps and collectives.

    Reads: custom_reward_function.timeout_s, actor_rollout_ref.rollout.max_server_restarts,
    trainer.max_consecutive_skipped_steps, actor_rollout_ref.nccl_timeout,
    actor_rollout_ref.rollout.server_startup_timeout_s
    """
    timeout_s = config.custom_reward_function.timeout_s
    restarts = config.actor_rollout_ref.rollout.max_server_restarts
    skipped = config.trainer.max_consecutive_skipped_steps
    nccl_timeout = config.actor_rollout_ref.nccl_timeout
    startup = config.actor_rollout_ref.rollout.server_startup_timeout_s
    if startup is not None and startup <= 0:
        yield (f"actor_rollout_ref.rollout.server_startup_timeout_s={startup}: must be > 0 seconds (or null: "
               "1800 for SGLang, 600 for the CPU engine)")
    if timeout_s <= 0:
        yield f"custom_reward_function.timeout_s={timeout_s}: must be > 0 seconds"
    if nccl_timeout <= 0:
        yield (f"actor_rollout_ref.nccl_timeout={nccl_timeout}: must be > 0 seconds (the bound of every "
               "collective of the training and weight-update groups)")
    if restarts < 0:
        yield f"actor_rollout_ref.rollout.max_server_restarts={restarts}: must be >= 0"
    if skipped < 1:
        yield f"trainer.max_consecutive_skipped_steps={skipped}: must be >= 1"


def agent_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Agentic rollouts: episode limits, the judge's URL and key, the endpoint's port.

    Reads: actor_rollout_ref.rollout.agent, actor_rollout_ref.rollout.ignore_eos
    """
    agent = config.actor_rollout_ref.rollout.agent
    if agent.path and config.actor_rollout_ref.rollout.ignore_eos:
        yield ("actor_rollout_ref.rollout.ignore_eos=true with rollout.agent.path: not built yet for agent episodes "
               "(their calls take the endpoint's own sampling parameters, megarl.agents.openai_api)")
    for key in ("max_turns", "max_tokens_per_episode", "max_concurrent_episodes"):
        yield from positive(f"actor_rollout_ref.rollout.agent.{key}", getattr(agent, key))
    if agent.episode_timeout_s <= 0:
        yield f"actor_rollout_ref.rollout.agent.episode_timeout_s={agent.episode_timeout_s}: must be > 0 seconds"
    if agent.judge.url and not agent.judge.url.startswith(("http://", "https://")):
        yield f"actor_rollout_ref.rollout.agent.judge.url={agent.judge.url!r}: must be an http(s) URL"
    if agent.judge.api_key_env and agent.judge.url and agent.judge.api_key_env not in os.environ:
        yield (f"actor_rollout_ref.rollout.agent.judge.api_key_env={agent.judge.api_key_env}: "
               "that environment variable is not set")
    yield from positive("actor_rollout_ref.rollout.agent.judge.max_tokens", agent.judge.max_tokens)
    if not 0 <= agent.port <= 65535:
        yield f"actor_rollout_ref.rollout.agent.port={agent.port}: must be a TCP port (0: a free one)"
