"""Rules for `<role>.megatron.override_transformer_config` (megarl.config.transformer_overrides):
what can be checked without megatron-core. The engine checks each name against megatron-core's
`TransformerConfig` when it builds (megarl.engines.megatron.transformer_overrides)."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.fp8_training import fp8_format, fp8_value_problems
from megarl.config.rules.common import DerivedSizes
from megarl.config.rules.experts import training_roles
from megarl.config.schema import ExperimentConfig
from megarl.config.transformer_overrides import (KEY, cp_comm_type_problems, megarl_key_problems, recompute_problems,
                                                 uneven_stage_problems)

GRADIENT_CHECKPOINTED = ("actor_rollout_ref.actor", "critic")  # the roles enable_gradient_checkpointing applies to


def transformer_overrides_fit(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Each training role's transformer overrides: recompute values megatron-core accepts and that
    agree with enable_gradient_checkpointing (actor and critic), no layout or dtype name that
    differs from the megarl key it comes from, and a context-parallel communication type
    (`cp_comm_type`) megatron-core names and megarl's groups can run, and uneven pipeline stages
    only by `num_layers_in_first_pipeline_stage` / `num_layers_in_last_pipeline_stage` at PP > 1;
    FP8 values megatron-core names, no fp8_param, and no FP8 in a LoRA role (its local layers have no
    FP8 GEMM: megarl.config.fp8_training).

    Reads: actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron, critic.enable, critic.megatron,
    reward_model.enable, reward_model.megatron, actor_rollout_ref.model.enable_gradient_checkpointing,
    actor_rollout_ref.model.dtype, actor_rollout_ref.model.lora.rank, critic.model.lora.rank
    """
    arr = config.actor_rollout_ref
    for section, megatron in training_roles(config):
        prefix, overrides = f"{section}.{KEY}", megatron.override_transformer_config
        checkpointed = arr.model.enable_gradient_checkpointing and section in GRADIENT_CHECKPOINTED
        yield from recompute_problems(prefix, overrides, checkpointed)
        yield from megarl_key_problems(prefix, section, overrides, megatron, arr.model.dtype)
        yield from cp_comm_type_problems(prefix, overrides)
        yield from uneven_stage_problems(prefix, overrides, megatron.pipeline_model_parallel_size)
        yield from fp8_value_problems(prefix, overrides)
        lora = {"actor_rollout_ref.actor": ("actor_rollout_ref.model.lora.rank", arr.model.lora.rank),
                "critic": ("critic.model.lora.rank", config.critic.model.lora.rank)}.get(section, ("", 0))
        if fp8_format(overrides) and lora[1] > 0:
            yield (f"{prefix}.fp8={fp8_format(overrides)} with {lora[0]}={lora[1]}: a LoRA role builds megatron's local "
                   "layers, which have no FP8 GEMM (megarl.config.fp8_training); train it without fp8")
