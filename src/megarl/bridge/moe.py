"""Mixture-of-experts in the bridge: the MoE part of an HF config, and the HF names of experts.

Supported: Qwen3-MoE and Qwen2-MoE (HF `mlp.gate`, `mlp.experts.<e>.{gate,up,down}_proj`; Qwen2-MoE
adds `mlp.shared_expert.*` and the sigmoid gate `mlp.shared_expert_gate`) and Mixtral
(`block_sparse_moe.gate`, `block_sparse_moe.experts.<e>.{w1,w3,w2}`). These are the names
`save_pretrained` writes and hub checkpoints hold; transformers 5 fuses a layer's experts in
memory (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F]) but never on disk.

megatron-core routing equivalences (transformer/moe/moe_utils.py `topk_routing_with_score_function`):
HF softmax over all experts -> top-k -> renormalise (`norm_topk_prob=True`, and always in Mixtral) is
megatron's top-k on the logits then softmax over the k (`moe_router_pre_softmax=False`); HF without
renormalisation (`norm_topk_prob=False`) is `moe_router_pre_softmax=True`. The Qwen2-MoE shared
expert, scaled by sigmoid(x . shared_expert_gate), is megatron's `moe_shared_expert_gate=True`.
gpt-oss (`mlp.router.{weight,bias}`; experts fused on disk, read per expert under the Qwen spelling
with biases: `megarl.bridge.fused_experts`) takes the top-k of the biased logits, then softmax over
the k (`GptOssTopKRouter`): megatron's `moe_router_pre_softmax=False` with the router's
`add_bias_linear` bias (transformer/moe/router.py `Router.gating`).

DeepSeek-V3 (`mlp.gate.weight`, the selection bias `mlp.gate.e_score_correction_bias`,
`mlp.experts.<e>.{gate,up,down}_proj`, `mlp.shared_experts.*`; HF DeepseekV3TopkRouter): sigmoid
scores; the experts are chosen on scores + bias (the bias never weights an expert), within the
`topk_group` of `n_group` groups whose two best biased scores sum highest; the chosen scores are
renormalised and multiplied by `routed_scaling_factor`. That is megatron's
`moe_router_score_function="sigmoid"` with `moe_router_enable_expert_bias` (the bias is the router's
`expert_bias` buffer, added for selection only: moe_utils.py `topk_routing_with_score_function`),
`moe_router_num_groups` / `moe_router_group_topk` (`group_limited_topk` sums each group's top
topk/group_topk scores: exact only where that is 2) and `moe_router_topk_scaling_factor`. Megatron
renormalises sigmoid weights exactly when top-k > 1, so `norm_topk_prob` must say the same. The first
`first_k_dense_replace` layers are dense (megatron's `moe_layer_freq` list).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from megarl.bridge.errors import ConversionError
from megarl.bridge.grouped_experts import is_grouped_expert, sequential_expert_name


@dataclass(frozen=True)
class MoESpec:
    """The MoE part of a decoder: each layer but the first `first_dense_layers` has experts. Sizes are counts."""

    scheme: str  # HF naming: "qwen" (mlp.experts.<e>.gate_proj) or "mixtral" (block_sparse_moe.experts.<e>.w1)
    num_experts: int
    topk: int
    expert_ffn_hidden_size: int  # one expert's MLP width
    shared_expert_ffn_hidden_size: int  # 0: no shared expert
    norm_topk_prob: bool  # top-k probabilities renormalised to sum 1
    aux_loss_coef: float  # HF `router_aux_loss_coef` (the model's own; training uses the config's)
    score_function: str = "softmax"  # "sigmoid": DeepSeek-V3
    expert_bias: bool = False  # a selection-only bias per expert (HF e_score_correction_bias)
    num_groups: Optional[int] = None  # group-limited top-k: experts in num_groups groups, group_topk chosen
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None  # routed expert weights multiplied by it (HF routed_scaling_factor)
    first_dense_layers: int = 0  # the first layers have a dense MLP of the arch's ffn_hidden_size

    @property
    def shared_expert(self) -> bool:
        return self.shared_expert_ffn_hidden_size > 0


def _count(config: Mapping[str, Any], keys: tuple[str, ...], source: str) -> int:
    for key in keys:
        value = config.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConversionError(f"{source}: `{key}` must be a positive integer, got {value!r}")
            return value
    raise ConversionError(f"{source}: `{keys[0]}` is missing (an MoE config needs it)")


def _deepseek_moe(config: Mapping[str, Any], source: str) -> MoESpec:
    """The MoE of a DeepSeek-V3 config (HF DeepseekV3MoE / DeepseekV3TopkRouter)."""
    for key, only in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if config.get(key, only) != only:
            raise ConversionError(f"{source}: `{key}`={config[key]!r} is not supported (only {only!r}, as HF's "
                                  "DeepseekV3ForCausalLM computes)")
    experts = _count(config, ("n_routed_experts",), source)
    topk = _count(config, ("num_experts_per_tok",), source)
    shared = _count(config, ("n_shared_experts",), source)
    ffn = _count(config, ("moe_intermediate_size",), source)
    groups, group_topk = _count(config, ("n_group",), source), _count(config, ("topk_group",), source)
    if experts % groups or group_topk > groups:
        raise ConversionError(f"{source}: `n_group`={groups} must divide `n_routed_experts`={experts} and be at "
                              f"least `topk_group`={group_topk}")
    limited = group_topk < groups  # else every group is chosen: plain top-k
    if limited and (topk // group_topk != 2 or experts // groups < 2):
        raise ConversionError(
            f"{source}: group-limited routing with `num_experts_per_tok`={topk}, `topk_group`={group_topk} is not "
            "supported: HF ranks a group by its 2 best scores, megatron-core by its num_experts_per_tok // "
            "topk_group best (moe_utils.py `group_limited_topk`); they agree only where that is 2")
    norm = bool(config.get("norm_topk_prob", True))
    if norm != (topk > 1):
        raise ConversionError(f"{source}: `norm_topk_prob`={norm} with `num_experts_per_tok`={topk} is not supported: "
                              "megatron-core renormalises sigmoid routing weights exactly when top-k > 1")
    scale = config.get("routed_scaling_factor", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale <= 0:
        raise ConversionError(f"{source}: `routed_scaling_factor` must be a positive number, got {scale!r}")
    dense = config.get("first_k_dense_replace", 0)
    layers = config.get("num_hidden_layers")
    if not isinstance(dense, int) or isinstance(dense, bool) or dense < 0 or (isinstance(layers, int) and dense >= layers):
        raise ConversionError(f"{source}: `first_k_dense_replace`={dense!r} must be an integer in [0, "
                              f"num_hidden_layers={layers})")
    if topk > experts:
        raise ConversionError(f"{source}: `num_experts_per_tok`={topk} exceeds the {experts} experts")
    return MoESpec("deepseek", experts, topk, ffn, shared * ffn, norm, 0.0, score_function="sigmoid",
                   expert_bias=True, num_groups=groups if limited else None,
                   group_topk=group_topk if limited else None,
                   scaling_factor=None if scale == 1 else float(scale), first_dense_layers=dense)


def moe_from_hf_config(config: Mapping[str, Any], scheme: str, source: str) -> MoESpec:
    """Read the MoE fields of an HF config of naming `scheme`; reject what megatron cannot express."""
    if scheme == "deepseek":
        return _deepseek_moe(config, source)
    if scheme == "gpt_oss":
        experts = _count(config, ("num_local_experts",), source)
        ffn = _count(config, ("intermediate_size",), source)
        shared, norm_topk = 0, True  # GptOssTopKRouter: softmax over the top-k logits
    elif scheme == "mixtral":
        experts = _count(config, ("num_local_experts",), source)
        ffn = _count(config, ("intermediate_size",), source)
        shared, norm_topk = 0, True  # MixtralSparseMoeBlock always renormalises the top-k weights
        if config.get("router_jitter_noise"):
            raise ConversionError(f"{source}: `router_jitter_noise`={config['router_jitter_noise']} is not supported (0 only)")
    else:
        # hub Qwen3-MoE configs say `num_experts`; transformers 5 writes `num_local_experts`
        experts = _count(config, ("num_experts", "num_local_experts"), source)
        ffn = _count(config, ("moe_intermediate_size",), source)
        shared = config.get("shared_expert_intermediate_size") or 0
        norm_topk = bool(config.get("norm_topk_prob", False))
        step = config.get("decoder_sparse_step", 1)
        if step != 1:
            raise ConversionError(f"{source}: `decoder_sparse_step`={step} is not supported (1: every layer is MoE)")
        if config.get("mlp_only_layers"):
            raise ConversionError(f"{source}: `mlp_only_layers`={config['mlp_only_layers']} is not supported (dense "
                                  "layers among MoE layers); only [] is")
    topk = _count(config, ("num_experts_per_tok",), source)
    if topk > experts:
        raise ConversionError(f"{source}: `num_experts_per_tok`={topk} exceeds the {experts} experts")
    return MoESpec(scheme, experts, topk, ffn, int(shared), norm_topk, float(config.get("router_aux_loss_coef", 0.0)))


# ------------------------------------------------------------------------------------------ names
_PREFIX = {"qwen": "model.layers.{i}.mlp.", "mixtral": "model.layers.{i}.block_sparse_moe.",
           "gpt_oss": "model.layers.{i}.mlp.", "deepseek": "model.layers.{i}.mlp."}
_EXPERT_PROJ = {"qwen": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2"),
                "gpt_oss": ("gate_proj", "up_proj", "down_proj"), "deepseek": ("gate_proj", "up_proj", "down_proj")}
_ROUTER = {"qwen": "gate", "mixtral": "gate", "gpt_oss": "router", "deepseek": "gate"}


def hf_router(scheme: str, kind: str = "weight") -> str:
    return _PREFIX[scheme] + _ROUTER[scheme] + "." + kind


def hf_expert(scheme: str, which: str, kind: str = "weight") -> str:
    """HF name template ("{i}" layer, "{e}" expert) of an expert's `gate`, `up` or `down` projection."""
    proj = dict(zip(("gate", "up", "down"), _EXPERT_PROJ[scheme]))[which]
    return _PREFIX[scheme] + "experts.{e}." + proj + "." + kind


EXPERT_MCORE = re.compile(r"(?:^|\.)mlp\.experts\.local_experts\.(\d+)\.")


def expert_index(mcore_name: str) -> Optional[int]:
    """The expert index in a megatron name, sequential (`...mlp.experts.local_experts.<e>...`) or
    grouped-GEMM (`...mlp.experts.linear_fc1.weight<e>`) spelling, else None."""
    m = EXPERT_MCORE.search(sequential_expert_name(mcore_name))
    return int(m.group(1)) if m else None


def shift_expert(mcore_name: str, offset: int) -> str:
    """Add `offset` to the expert index of a sequential-spelled megatron expert name (local <->
    global numbering). A grouped-GEMM name is refused: translate it with `sequential_expert_name`."""
    if is_grouped_expert(mcore_name):
        raise ConversionError(f"shift_expert: {mcore_name!r} is grouped-GEMM spelled; translate it with "
                              "sequential_expert_name first")
    return EXPERT_MCORE.sub(lambda m: m.group(0).replace(f".{m.group(1)}.", f".{int(m.group(1)) + offset}."),
                            mcore_name, count=1)


_HF_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_HF_EXPERT_BIAS = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.bias$")
_HF_SHARED = re.compile(r"\.shared_experts?\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_shape(moe: MoESpec, hidden: int, hf_name: str) -> Optional[tuple[int, ...]]:
    """The shape of an MoE HF tensor (router, expert, shared expert), None for other tensors."""
    if hf_name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")):
        return (moe.num_experts, hidden)
    if hf_name.endswith("mlp.router.bias"):
        return (moe.num_experts,)
    m = _HF_EXPERT_BIAS.search(hf_name)
    if m:
        return (hidden,) if m.group(1) == "down_proj" else (moe.expert_ffn_hidden_size,)
    if hf_name.endswith("mlp.shared_expert_gate.weight"):
        return (1, hidden)
    if hf_name.endswith("mlp.gate.e_score_correction_bias"):
        return (moe.num_experts,)
    for pattern, ffn in ((_HF_EXPERT, moe.expert_ffn_hidden_size), (_HF_SHARED, moe.shared_expert_ffn_hidden_size)):
        m = pattern.search(hf_name)
        if m:
            return (hidden, ffn) if m.group(1) in ("down_proj", "w2") else (ffn, hidden)
    return None


def transformer_config_kwargs(moe: MoESpec) -> dict[str, Any]:
    """megatron `TransformerConfig` MoE arguments for `moe` (no load-balancing loss: callers that
    train set `moe_router_load_balancing_type` and the coefficients)."""
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=moe.shared_expert and moe.scheme == "qwen",  # DeepSeek's shared experts are ungated
        moe_router_score_function=moe.score_function,
        moe_router_enable_expert_bias=moe.expert_bias,
        # the bias is HF's, loaded: megarl never updates it (aux-loss-free balancing is a pre-training method)
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,  # SequentialMLP; the engine's moe_settings sets it (megarl.config.expert_mlp)
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )
