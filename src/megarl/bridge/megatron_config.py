"""`ModelArch` -> megatron-core `TransformerConfig` arguments, `GPTModel` arguments, layer spec.

megatron-core is imported only by the functions that need it.
"""
from __future__ import annotations

from typing import Any

import torch

from megarl.bridge.arch import ModelArch
from megarl.bridge.moe import transformer_config_kwargs as moe_kwargs
from megarl.bridge.sharding import ParallelLayout, check_layout


def transformer_config_kwargs(
    arch: ModelArch, layout: ParallelLayout = ParallelLayout(), params_dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """Keyword arguments of `TransformerConfig` for `arch` at `layout`.

    Dropout is 0 and every fusion is left at its default (off in megatron-core 0.16.1); callers
    add training settings (recompute, sequence parallel, fusions on GPU) on top.
    """
    check_layout(arch, layout)
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        rotary_interleaved=False,  # HF's rotate_half convention: no q/k row permutation
        window_size=None if arch.sliding_window is None else (arch.sliding_window - 1, 0),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=layout.first_stage_layers,
        num_layers_in_last_pipeline_stage=layout.last_stage_layers,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    if arch.moe is not None:
        kwargs.update(moe_kwargs(arch.moe), expert_model_parallel_size=layout.ep,
                      expert_tensor_parallel_size=layout.expert_tp)
    kwargs.update(gpt_oss_kwargs(arch))
    return kwargs


def gpt_oss_kwargs(arch: ModelArch) -> dict[str, Any]:
    """`TransformerConfig` arguments of gpt-oss's features (none for other models): sinks are
    megatron's `softmax_type="learnable"` (a `softmax_offset` [heads] per layer, a softmax over
    the keys and the sink: transformer/dot_product_attention.py, fusions/fused_softmax.py
    `SoftmaxOne`); the window on the layers HF's `layer_types` marks sliding is
    `window_attn_skip_freq` as a per-layer list (1: windowed; transformer/utils.py
    `is_layer_window_attention`); every linear has a bias (`add_bias_linear`); HF's clamped SwiGLU
    is megatron's GLU with `quick_gelu` (x sigmoid(1.702 x)), the gate clamped above and the linear
    half to [-c, c] (`activation_func_clamp_value`), plus 1 (`glu_linear_offset`) (transformer/mlp.py `glu`)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    out: dict[str, Any] = {}
    if arch.attention_sinks:
        out["softmax_type"] = "learnable"
    if arch.window_layers is not None and arch.sliding_window is not None:
        out["window_attn_skip_freq"] = [int(w) for w in arch.window_layers]
    if arch.linear_bias:
        out["add_bias_linear"] = True
    if arch.swiglu_clamp is not None:
        out.update(activation_func=quick_gelu, activation_func_clamp_value=arch.swiglu_clamp, glu_linear_offset=1.0)
    return out


def yarn_config_attributes(arch: ModelArch) -> dict[str, Any]:
    """Attributes `GPTModel(position_embedding_type="yarn")` reads from its `TransformerConfig`
    (models/gpt/gpt_model.py `getattr(self.config, "yarn_...")`; the attention applies the
    concentration factor from them, transformer/attention.py `_yarn_get_concentration_factor_from_config`),
    which `TransformerConfig` has no fields for: set them on the config object (`set_yarn_attributes`)."""
    scaling = arch.rope_scaling
    if scaling is None or scaling.kind != "yarn":
        return {}
    return dict(yarn_rotary_scaling_factor=scaling.factor,
                yarn_original_max_position_embeddings=scaling.original_max_position_embeddings,
                yarn_beta_fast=scaling.beta_fast, yarn_beta_slow=scaling.beta_slow,
                yarn_mscale=None, yarn_mscale_all_dim=None,  # HF's default attention factor: 0.1 ln(factor) + 1
                yarn_correction_range_round_to_int=scaling.truncate)


def set_yarn_attributes(config, arch: ModelArch):
    """`config` (a megatron `TransformerConfig`) with `yarn_config_attributes(arch)` set on it."""
    for name, value in yarn_config_attributes(arch).items():
        setattr(config, name, value)
    return config


def gpt_model_kwargs(arch: ModelArch, padded_vocab_size: int) -> dict[str, Any]:
    """Keyword arguments of `GPTModel` (besides config, spec, pre/post_process and vp_stage)."""
    scaling = arch.rope_scaling
    return dict(
        vocab_size=padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        position_embedding_type="yarn" if scaling is not None and scaling.kind == "yarn" else "rope",
        rotary_percent=1.0,
        rotary_base=arch.rope_theta,
        rope_scaling=scaling is not None and scaling.kind == "llama3",
        rope_scaling_factor=scaling.factor if scaling is not None and scaling.kind == "llama3" else 8.0,
        seq_len_interpolation_factor=scaling.factor if scaling is not None and scaling.kind == "linear" else None,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )


def layer_spec(arch: ModelArch, transformer_engine: bool = False, grouped_gemm: bool = False):
    """The megatron-core layer spec: local modules (CPU and tests) or transformer-engine ones.
    MoE layers run their experts as SequentialMLP (one MLP per expert, `local_experts.<k>.linear_fc1`),
    or with `grouped_gemm` (TE spec only) as TEGroupedMLP (`experts.linear_fc1.weight<k>`, which the
    bridge reads as the sequential name: `megarl.bridge.grouped_experts`). `megarl.config.expert_mlp`
    decides; the local spec would take `grouped_gemm` as megatron's legacy GroupedMLP, so it is refused."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    experts = arch.moe.num_experts if arch.moe else None
    if transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=arch.qk_layernorm
        )
    if grouped_gemm:
        raise ValueError("layer_spec: grouped GEMM needs the transformer-engine spec (TEGroupedMLP); the local "
                         "spec would build megatron's legacy GroupedMLP")
    return get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm,
                                    normalization="RMSNorm")
