"""The config rules: small named checks of a resolved config, run in order by `validate()`.

A rule is a function `rule(config, sizes)` that yields one message per problem it finds, each
naming its key path; `sizes` are the GPU counts and data-parallel sizes derived once from the
config. Its docstring says what it checks and ends with a `Reads:` line listing the keys (or whole
groups) it reads. To add a rule, write the function in the module of its topic and list it in RULES.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from megarl.config.rules.access import api_key_env_is_set
from megarl.config.rules.checkpoint import checkpoint_contents, checkpoint_export_options, checkpoint_without_extra
from megarl.config.rules.async_modes import async_modes_correct_off_policy, async_modes_fit_the_loop
from megarl.config.rules.choices import (
    batched_requests_fit_rollout,
    filter_groups_has_groups,
    gae_has_critic,
    gen_batch_only_with_dynamic_sampling,
    group_estimator_has_groups,
    lr_schedule_has_step_count,
    min_lr_fits,
    offload_in_split_placement,
    offload_only_where_it_happens,
    reward_model_holds_a_sequence,
    reward_model_settings,
    rollout_engine_fits_device,
    rollout_engine_kwargs_are_sglangs,
    rollout_engine_kwargs_warnings,
    deterministic_inference_fits_device,
    token_budget_holds_a_sequence,
    warmup_fits_schedule,
)
from megarl.config.rules.common import DerivedSizes
from megarl.config.rules.devices import weight_sync_transport_fits_devices
from megarl.config.rules.distillation import distillation_settings, distillation_teacher_fits
from megarl.config.rules.experts import (
    expert_parallel_fits_role,
    grouped_gemm_can_run,
    rollout_expert_parallel_fits_server,
)
from megarl.config.rules.fsdp2 import fsdp2_optimizer_override_warnings, megatron_fsdp_runs_as_fsdp2, torch_fsdp2_fits
from megarl.config.rules.gpus import (
    batch_arithmetic,
    parallel_sizes_fit_training_gpus,
    placement_pools,
    rollout_attention_data_parallel_fits_server,
    rollout_servers_fit_nodes,
)
from megarl.config.rules.lora import lora_settings
from megarl.config.rules.mtp import mtp_settings
from megarl.config.rules.policy_loss import (clip_ratio_alone_differs_from_verl, loss_mode_aggregates_itself,
                                             policy_loss_options)
from megarl.config.rules.profiler import profiler_settings
from megarl.config.rules.qat import qat_settings, qat_warnings
from megarl.config.rules.quantization import fp8_rollout_corrected, fp8_rollout_fits
from megarl.config.rules.rollout_correction import (bypass_replaces_loss_mode, rollout_correction_fits_actor,
                                                    rollout_correction_settings)
from megarl.config.rules.router_replay import router_replay_fits
from megarl.config.rules.skip_rows import skip_rows_exact
from megarl.config.rules.sync import weight_check_needs_cpu_engine
from megarl.config.rules.transformer import transformer_overrides_fit
from megarl.config.rules.values import (
    agent_settings,
    dpo_ranges,
    fault_limits,
    importance_cap_range,
    known_loggers,
    positive_counts,
    required_keys,
    dist_checkpoint_given,
    resume_path_given,
    rollout_log_probs_without_tis,
    value_ranges,
)
from megarl.config.schema import ExperimentConfig

Rule = Callable[[ExperimentConfig, DerivedSizes], Iterable[str]]

# validate() runs the rules in this order and lists their messages in this order.
RULES: list[Rule] = [
    required_keys,
    positive_counts,
    value_ranges,
    known_loggers,
    resume_path_given,
    dist_checkpoint_given,
    checkpoint_contents,
    token_budget_holds_a_sequence,
    group_estimator_has_groups,
    gae_has_critic,
    reward_model_holds_a_sequence,
    filter_groups_has_groups,
    importance_cap_range,
    policy_loss_options,
    rollout_log_probs_without_tis,
    rollout_correction_settings,
    rollout_correction_fits_actor,
    distillation_settings,
    lora_settings,
    mtp_settings,
    skip_rows_exact,
    gen_batch_only_with_dynamic_sampling,
    lr_schedule_has_step_count,
    warmup_fits_schedule,
    min_lr_fits,
    dpo_ranges,
    fault_limits,
    api_key_env_is_set,
    agent_settings,
    reward_model_settings,
    offload_only_where_it_happens,
    rollout_engine_fits_device,
    rollout_engine_kwargs_are_sglangs,
    batched_requests_fit_rollout,
    deterministic_inference_fits_device,
    fp8_rollout_fits,
    weight_sync_transport_fits_devices,
    weight_check_needs_cpu_engine,
    placement_pools,
    async_modes_fit_the_loop,
    rollout_servers_fit_nodes,
    parallel_sizes_fit_training_gpus,
    distillation_teacher_fits,
    expert_parallel_fits_role,
    rollout_expert_parallel_fits_server,
    rollout_attention_data_parallel_fits_server,
    grouped_gemm_can_run,
    transformer_overrides_fit,
    router_replay_fits,
    profiler_settings,
    qat_settings,
    torch_fsdp2_fits,
    batch_arithmetic,
]

# Rules whose messages are warnings: what they find runs (as in verl, which warns), but is likely a mistake
WARNING_RULES: list[Rule] = [
    rollout_engine_kwargs_warnings,
    async_modes_correct_off_policy,
    offload_in_split_placement,
    bypass_replaces_loss_mode,
    loss_mode_aggregates_itself,
    fp8_rollout_corrected,
    checkpoint_without_extra,
    checkpoint_export_options,
    megatron_fsdp_runs_as_fsdp2,
    fsdp2_optimizer_override_warnings,
    qat_warnings,
]

# Warning rules that read keys as the user left them, before megarl.config.validate.resolve fills the ones whose
# None means "same as another key"
UNRESOLVED_WARNING_RULES: list[Rule] = [
    clip_ratio_alone_differs_from_verl,
]

__all__ = ["RULES", "UNRESOLVED_WARNING_RULES", "WARNING_RULES", "DerivedSizes", "Rule"]
