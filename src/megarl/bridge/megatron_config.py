"""`ModelArch` -> megatron-core `TransformerConfig` arguments, `GPTModel` arguments, layer spec.

megatron-core is imported only by the functions that need it.
"""
from __future__ import annotations

from typing import Any

import torch

from megarl.bridge.arch import ModelArch
from megarl.bridge.moe import transformer_config_kwargs as moe_kwargs
from megarl.bridge.sharding import ParallelLayout, check_layout, chunk_layers, layer_offset


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
        account_for_embedding_in_pipeline_split=layout.embedding_in_split,
        account_for_loss_in_pipeline_split=layout.loss_in_split,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    if arch.moe is not None:
        kwargs.update(moe_kwargs(arch.moe), expert_model_parallel_size=layout.ep,
                      expert_tensor_parallel_size=layout.expert_tp)
        if arch.moe.first_dense_layers:  # 0: a dense layer, 1: an MoE layer (get_gpt_decoder_layer_specs)
            kwargs["moe_layer_freq"] = [int(arch.is_moe_layer(i)) for i in range(arch.num_layers)]
    if arch.mla is not None:
        kwargs.update(mla_kwargs(arch))
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
    if scaling is None or scaling.kind != "yarn" or arch.mla is not None:  # MLA: its own YaRN (mla_kwargs)
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


def mla_kwargs(arch: ModelArch) -> dict[str, Any]:
    """`MLATransformerConfig` fields of a multi-latent-attention `arch`. Its q/kv latent norms are
    megatron's `qk_layernorm` (gpt_layer_specs.py: q_layernorm / kv_layernorm, or the transformer-engine
    up projections' fused norms)."""
    m, scaling = arch.mla, arch.rope_scaling
    kwargs = dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank,
                  qk_head_dim=m.qk_nope_head_dim, qk_pos_emb_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  qk_layernorm=True, rotary_base=arch.rope_theta, rope_type="rope")
    if scaling is not None:
        if scaling.kind != "yarn":
            raise ValueError(f"multi-latent attention with {scaling.kind} rope scaling (megatron's MLA: rope or yarn)")
        kwargs.update(rope_type="yarn", rotary_scaling_factor=scaling.factor,
                      original_max_position_embeddings=scaling.original_max_position_embeddings,
                      beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, mscale=scaling.mscale,
                      mscale_all_dim=scaling.mscale_all_dim)
    else:  # MLASelfAttention's softmax scale is yarn_mscale(rotary_scaling_factor, mscale_all_dim) ** 2: 1 here
        kwargs.update(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return kwargs


def config_class(arch: ModelArch):
    """The megatron-core config class of `arch`: `MLATransformerConfig` for multi-latent attention."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if arch.mla is not None else TransformerConfig


def gpt_model_kwargs(arch: ModelArch, padded_vocab_size: int) -> dict[str, Any]:
    """Keyword arguments of `GPTModel` (besides config, spec, pre/post_process and vp_stage)."""
    scaling = arch.rope_scaling
    return dict(
        vocab_size=padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        # YaRN: GPTModel's own for q/k/v attention (gpt-oss); multi-latent attention rotates inside (mla_kwargs)
        position_embedding_type="yarn" if scaling is not None and scaling.kind == "yarn" and arch.mla is None else "rope",
        rotary_percent=arch.rotary_percent,
        rotary_base=arch.rope_theta,
        rope_scaling=scaling is not None and scaling.kind == "llama3",
        rope_scaling_factor=scaling.factor if scaling is not None and scaling.kind == "llama3" else 8.0,
        seq_len_interpolation_factor=scaling.factor if scaling is not None and scaling.kind == "linear" else None,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
    )


def layer_spec(arch: ModelArch, transformer_engine: bool = False, grouped_gemm: bool = False, dense: bool = False):
    """The megatron-core layer spec: local modules (CPU and tests) or transformer-engine ones.
    MoE layers run their experts as SequentialMLP (one MLP per expert, `local_experts.<k>.linear_fc1`),
    or with `grouped_gemm` (TE spec only) as TEGroupedMLP (`experts.linear_fc1.weight<k>`, which the
    bridge reads as the sequential name: `megarl.bridge.grouped_experts`). `megarl.config.expert_mlp`
    decides; the local spec would take `grouped_gemm` as megatron's legacy GroupedMLP, so it is refused.
    `dense`: the spec of the dense first layers of an MoE model (`block_spec` puts each layer's in place).

    Multi-latent attention: megatron's local spec has column-parallel down projections, its
    transformer-engine spec replicated ones (gpt_layer_specs.py); megarl gives the transformer-engine
    spec column-parallel ones too (TEColumnParallelLinear, which MLASelfAttention accepts and gathers),
    so that one TP split (megarl.bridge.mapping) serves both. The local spec's latent norms are saved
    under the transformer-engine keys (`sharded_state_dict_keys_map`, as megatron maps the local
    spec's input norm). A dense layer's pre-MLP norm in an MoE model is saved as `pre_mlp_layernorm`
    on both specs (the engine's checkpoints: `megarl.bridge.torch_dist_io.te_moe_norm_key`)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    experts = arch.moe.num_experts if arch.moe and not dense else None
    mla = arch.mla is not None
    qk_norm = arch.qk_layernorm or mla
    if transformer_engine:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=qk_norm, multi_latent_attention=mla)
        if mla:
            from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

            attention = spec.submodules.self_attention.submodules
            attention.linear_q_down_proj = attention.linear_kv_down_proj = TEColumnParallelLinear
        return spec
    if grouped_gemm:
        raise ValueError("layer_spec: grouped GEMM needs the transformer-engine spec (TEGroupedMLP); the local "
                         "spec would build megatron's legacy GroupedMLP")
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk_norm,
                                    multi_latent_attention=mla, normalization="RMSNorm")
    if mla:
        keys = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
        spec.submodules.sharded_state_dict_keys_map = {**spec.submodules.sharded_state_dict_keys_map, **keys}
    return spec


def block_spec(arch: ModelArch, layout: ParallelLayout, pp_rank: int, vp_stage: int, moe_spec, dense_spec):
    """The decoder spec of model chunk (pp_rank, vp_stage): `moe_spec` (every layer's, as `layer_spec`
    gives) where all layers are alike, else the chunk's layers, each dense (`dense_spec`) or MoE, as
    megatron's `get_gpt_decoder_block_spec` slices a `moe_layer_freq` list."""
    if arch.moe is None or not arch.moe.first_dense_layers:
        return moe_spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    start = layer_offset(arch.num_layers, layout, pp_rank, vp_stage)
    layers = range(start, start + chunk_layers(arch.num_layers, layout, pp_rank, vp_stage))
    return TransformerBlockSubmodules(layer_specs=[moe_spec if arch.is_moe_layer(i) else dense_spec for i in layers],
                                      layer_norm=LayerNormImpl)
