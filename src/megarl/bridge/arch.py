"""Supported HF architectures and the translation of an HF `config.json` into `ModelArch`.

A `Family` states, declaratively, how one HF `model_type` differs from the common dense decoder
(RMSNorm, SwiGLU, RoPE, grouped-query attention, no linear biases). `arch_from_hf_config` reads a
config into a `ModelArch` and rejects, naming the field, every setting megatron-core cannot
express exactly: nothing is silently approximated.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from megarl.bridge.errors import ConversionError
from megarl.bridge.moe import MoESpec, moe_from_hf_config


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # HF class name written into an exported config.json
    qkv_bias: bool  # q/k/v projections carry a bias (o_proj never does)
    qk_layernorm: bool  # per-head RMSNorm on q and k, before RoPE
    must_be_false: tuple[str, ...]  # HF fields with no exact megatron-core equivalent when true
    sliding_window_field: bool  # `sliding_window` (when set) is applied to every layer
    moe: Optional[str] = None  # MoE naming scheme (megarl.bridge.moe): "qwen", "mixtral", "gpt_oss", "deepseek";
    # None: dense
    mla: bool = False  # multi-latent attention (DeepSeek-V2/V3: `MLASpec`) instead of q/k/v projections
    # config fields that switch `qkv_bias` / `qk_layernorm` on (GLM-4.5: attention_bias, use_qk_norm)
    qkv_bias_key: Optional[str] = None
    qk_norm_key: Optional[str] = None
    partial_rotary: bool = False  # `partial_rotary_factor` < 1 allowed (megatron's rotary_percent)
    mtp: bool = False  # `num_nextn_predict_layers` multi-token-prediction layers may follow the last layer


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        # attention_bias=True puts a bias on o_proj too; megatron-core can only add that together
        # with biases on every linear (add_bias_linear), which these models do not have.
        Family("llama", "LlamaForCausalLM", False, False, ("attention_bias", "mlp_bias"), False),
        Family("mistral", "MistralForCausalLM", False, False, (), True),
        Family("qwen2", "Qwen2ForCausalLM", True, False, ("use_sliding_window",), False),
        Family("qwen3", "Qwen3ForCausalLM", False, True, ("attention_bias", "use_sliding_window"), False),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", True, False, ("use_sliding_window",), False, moe="qwen"),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", False, True, ("attention_bias", "use_sliding_window"), False,
               moe="qwen"),
        Family("mixtral", "MixtralForCausalLM", False, False, (), True, moe="mixtral"),
        # sinks, alternating windows, biases on every linear, clamped SwiGLU: `gpt_oss_fields`
        Family("gpt_oss", "GptOssForCausalLM", True, False, (), False, moe="gpt_oss"),
        # DeepSeek-V3, DeepSeek-V3.1, Kimi-K2: MLA, sigmoid routing with a selection bias, dense first layers
        Family("deepseek_v3", "DeepseekV3ForCausalLM", False, False, ("attention_bias",), False, moe="deepseek",
               mla=True, mtp=True),
        # GLM-4.5 / GLM-4.5-Air: DeepSeek-V3's router and expert names on grouped-query attention with
        # q/k/v biases (attention_bias: o_proj has none), optional q/k norms and partial rotary
        Family("glm4_moe", "Glm4MoeForCausalLM", False, False, (), False, moe="deepseek",
               qkv_bias_key="attention_bias", qk_norm_key="use_qk_norm", partial_rotary=True, mtp=True),
    )
}


@dataclass(frozen=True)
class RopeScaling:
    kind: Literal["llama3", "linear", "yarn"]
    factor: float
    # YaRN only (HF modeling_rope_utils `_compute_yarn_parameters`; megatron YarnRotaryEmbedding):
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # the cos/sin factor is yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim); MLA also
    # scales its softmax by yarn_mscale(factor, mscale_all_dim) ** 2 (megatron: mscale=1, all_dim=0: none)
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True  # round the correction range to integers (megatron's correction_range_round_to_int)


@dataclass(frozen=True)
class MLASpec:
    """Multi-latent attention (DeepSeek-V2/V3) sizes, per head unless a rank. q is `q_a_proj` (hidden ->
    q_lora_rank), RMSNorm, `q_b_proj` (-> heads x (nope + rope)), or one `q_proj` when q_lora_rank is None;
    `kv_a_proj_with_mqa` gives kv_lora_rank latent + one shared rope key, `kv_b_proj` (after RMSNorm)
    gives heads x (k nope + v)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


SEQ_CLS_SUFFIX = "ForSequenceClassification"

# megatron-core's llama3 scaling hard-codes these (rotary_pos_embedding.py `_apply_scaling`)
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelArch:
    """A decoder (dense, or MoE with `moe`) as both sides need it. Sizes are counts; `kv_channels` is the head dim."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    vocab_size: int
    norm_epsilon: float
    rope_theta: float
    rope_scaling: Optional[RopeScaling]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    sliding_window: Optional[int]  # tokens a query attends to, itself included; None: unlimited
    rotary_percent: float = 1.0  # the leading fraction of each head's dims that RoPE rotates (HF partial_rotary_factor)
    # a reward model (HF *ForSequenceClassification, num_labels=1): the scalar head `score.weight`
    # [1, H] (megatron `output_layer.weight` [1, H]) replaces the LM head
    score_head: bool = False
    moe: Optional[MoESpec] = None  # experts of the MoE layers' MLP; None: a dense MLP of ffn_hidden_size
    mla: Optional[MLASpec] = None  # multi-latent attention; None: q/k/v projections of kv_channels per head
    # DeepSeek-V3's multi-token-prediction layers (`num_nextn_predict_layers`), stored after the last layer:
    # not trained; their tensors are left out on import, as transformers' DeepseekV3ForCausalLM leaves them
    mtp_layers: int = 0
    # gpt-oss: which layers use `sliding_window` (None: all, where it is set), a learnable sink
    # logit per head in every softmax, a bias on every linear (o_proj, router, experts), and the
    # clamped SwiGLU (gate clamped above, up to [-c, c], gate * sigmoid(1.702 gate) * (up + 1))
    window_layers: Optional[tuple[bool, ...]] = None
    attention_sinks: bool = False
    linear_bias: bool = False
    swiglu_clamp: Optional[float] = None

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` (global, from 0) has experts; the first `moe.first_dense_layers` are dense."""
        return self.moe is not None and layer >= self.moe.first_dense_layers

    @property
    def has_dense_layers(self) -> bool:
        return self.moe is None or self.moe.first_dense_layers > 0

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def lm_head_tied(self) -> bool:
        """The LM output layer is the input embedding (never true for a score head)."""
        return self.tie_word_embeddings and not self.score_head

    @property
    def hf_architecture(self) -> str:
        """The HF class name an exported config.json states."""
        if self.score_head:
            return self.family.architecture.removesuffix("ForCausalLM") + SEQ_CLS_SUFFIX
        return self.family.architecture


def load_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of an HF checkpoint directory."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found (an HF checkpoint directory has a config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None


def _positive_int(config: Mapping[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConversionError(f"{source}: `{key}` must be a positive integer, got {value!r}")
    return value


def _rope(config: Mapping[str, Any], source: str, yarn: bool = False, mla: bool = False,
          partial_ok: bool = False) -> tuple[float, Optional[RopeScaling]]:
    """`rope_theta` and the scaling; `yarn`: YaRN is accepted (gpt_oss and multi-latent attention, where
    HF's and megatron-core's are checked equal); `mla`: the model has multi-latent attention, whose rope
    is plain or YaRN; `partial_ok`: a `partial_rotary_factor` below 1 is read by `_partial_rotary`."""
    # transformers >= 5 writes `rope_parameters`; older configs write `rope_theta` + `rope_scaling`
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ConversionError(f"{source}: per-layer-type `rope_parameters` are not supported")
    theta = params.get("rope_theta", config.get("rope_theta"))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConversionError(f"{source}: `rope_theta` must be a positive number, got {theta!r}")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not partial_ok:
        raise ConversionError(f"{source}: `partial_rotary_factor`={partial} is not supported (only 1.0)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if mla and kind != "yarn":
        raise ConversionError(f"{source}: rope scaling `rope_type`={kind!r} is not supported with multi-latent "
                              "attention (megatron-core's MLA: default or yarn)")
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ConversionError(f"{source}: rope scaling `{kind}` needs a positive `factor`, got {factor!r}")
    if kind == "linear":
        return float(theta), RopeScaling("linear", float(factor))
    if kind == "llama3":
        for key, fixed in LLAMA3_FIXED.items():
            if params.get(key) != fixed:
                raise ConversionError(
                    f"{source}: llama3 rope scaling with `{key}`={params.get(key)!r} is not supported: "
                    f"megatron-core hard-codes {key}={fixed}"
                )
        return float(theta), RopeScaling("llama3", float(factor))
    if kind == "yarn" and yarn:
        return float(theta), (_yarn_mla if mla else _yarn_gpt_oss)(params, float(factor), source)
    raise ConversionError(
        f"{source}: rope scaling `rope_type`={kind!r} is not supported (supported: default, linear, llama3"
        f"{', yarn' if yarn else ''})"
    )


def _yarn_mla(params: Mapping[str, Any], factor: float, source: str) -> RopeScaling:
    """YaRN as megatron's MLA computes it (YarnRotaryEmbedding, `_yarn_get_concentration_factor`,
    MLASelfAttention's softmax_scale), checked against HF `_compute_yarn_parameters` / `yarn_apply_mscale`:
    HF's cos/sin factor is mscale(f, mscale) / mscale(f, mscale_all_dim) only when both are set (else
    mscale(f, 1)) while its softmax scale uses mscale_all_dim alone; megatron takes both from one pair."""
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise ConversionError(f"{source}: yarn rope scaling needs a positive `original_max_position_embeddings`, "
                              f"got {original!r}")
    if params.get("attention_factor") is not None:
        raise ConversionError(f"{source}: yarn `attention_factor`={params['attention_factor']!r} is not supported: "
                              "megatron-core derives it from `mscale` and `mscale_all_dim`")
    if params.get("truncate", True) is not True:
        raise ConversionError(f"{source}: yarn `truncate`={params['truncate']!r} is not supported: megatron-core's MLA "
                              "rounds the correction range (correction_range_round_to_int=True)")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if all_dim and not mscale:
        raise ConversionError(f"{source}: yarn `mscale_all_dim`={all_dim} without `mscale` is not supported: HF "
                              "then scales cos/sin by mscale(factor, 1) but the softmax by mscale_all_dim, which "
                              "megatron-core's one (mscale, mscale_all_dim) pair cannot express")
    if not all_dim:
        mscale, all_dim = 1.0, 0.0  # HF: cos/sin by mscale(factor, 1), softmax unscaled
    return RopeScaling("yarn", factor, original, float(params.get("beta_fast") or 32),
                       float(params.get("beta_slow") or 1), float(mscale), float(all_dim))


def _mla(config: Mapping[str, Any], source: str) -> MLASpec:
    """The multi-latent attention sizes of a DeepSeek-V3 config."""
    if config.get("rope_interleave", True) is not True:
        raise ConversionError(f"{source}: `rope_interleave`={config['rope_interleave']!r} is not supported: "
                              "megatron-core's MLA always de-interleaves the rope dims (rope_utils.py "
                              "`_apply_rotary_pos_emb_bshd`, multi_latent_attention)")
    q_lora = config.get("q_lora_rank")
    rope = _positive_int(config, "qk_rope_head_dim", source)
    if config.get("head_dim", rope) != rope:  # HF's rotary embedding is built for `head_dim` dims
        raise ConversionError(f"{source}: `head_dim`={config['head_dim']!r} must equal `qk_rope_head_dim`={rope} "
                              "with multi-latent attention (HF rotates head_dim dims of the rope part)")
    return MLASpec(
        q_lora_rank=None if q_lora is None else _positive_int(config, "q_lora_rank", source),
        kv_lora_rank=_positive_int(config, "kv_lora_rank", source),
        qk_nope_head_dim=_positive_int(config, "qk_nope_head_dim", source),
        qk_rope_head_dim=_positive_int(config, "qk_rope_head_dim", source),
        v_head_dim=_positive_int(config, "v_head_dim", source),
    )


def _yarn_gpt_oss(params: Mapping[str, Any], factor: float, source: str) -> RopeScaling:
    """gpt-oss's YaRN as HF computes it (modeling_rope_utils `_compute_yarn_parameters`) and megatron's
    `YarnRotaryEmbedding` does: the same ramp between interpolated and extrapolated frequencies
    and cos/sin times 0.1 ln(factor) + 1. HF's `attention_factor` and `mscale`/`mscale_all_dim`
    (which megatron reads under other conditions) are refused."""
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            raise ConversionError(f"{source}: yarn rope scaling with `{key}`={params[key]!r} is not supported "
                                  "(only the default attention factor 0.1 ln(factor) + 1)")
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise ConversionError(f"{source}: yarn rope scaling needs a positive `original_max_position_embeddings`, "
                              f"got {original!r}")
    return RopeScaling("yarn", factor, original, float(params.get("beta_fast") or 32.0),
                       float(params.get("beta_slow") or 1.0), truncate=bool(params.get("truncate", True)))


def _score_head(config: Mapping[str, Any], source: str) -> bool:
    """True for a `*ForSequenceClassification` config; it must have exactly one label (a scalar
    reward). HF stores the label count as `id2label` (or `num_labels`), default 2."""
    architectures = config.get("architectures") or []
    if not any(str(a).endswith(SEQ_CLS_SUFFIX) for a in architectures):
        return False
    labels = config.get("id2label")
    num_labels = len(labels) if labels else config.get("num_labels", 2)
    if num_labels != 1:
        raise ConversionError(
            f"{source}: a sequence-classification checkpoint ({architectures[0]}) with num_labels={num_labels}; "
            "a reward model needs num_labels=1 (one scalar score, `score.weight` of shape [1, hidden_size])"
        )
    return True


# HF model_types whose linear-attention (gated delta net) layers megarl does not map, and why: they are
# refused by name instead of as an unknown model_type. transformers 5.25: qwen3_next (Qwen3-Next),
# qwen3_5 / qwen3_5_moe (Qwen3.5, with a vision tower) and their text-only configs.
GATED_DELTA_NET_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
GATED_DELTA_NET_BLOCKER = (
    "its gated delta net (linear attention) layers are not supported: megatron-core's GatedDeltaNet "
    "(0.16.1 megatron/core/ssm/gated_delta_net.py, 0.19.2 ssm/gated_delta_net/) raises ImportError when built "
    "unless flash-linear-attention (`fla`, which imports triton) is installed, and fla's Triton kernels do not run "
    "without a GPU (fla 0.6.0 on CPU: `RuntimeError: 0 active drivers ([]). There should only be one.`). Even with "
    "`deterministic_mode=True`, which swaps in megatron's torch_chunk_gated_delta_rule and a torch conv1d, the layer "
    "calls fla's Triton `l2norm` on q and k; megarl checks every family exactly against transformers on CPU, "
    "so none is wired yet (docs/lora-moe.md, 'Qwen3-Next and Qwen3.5')"
)


def supported_architectures() -> str:
    """The HF architectures megarl maps onto megatron-core, with their model_type, for messages."""
    causal = ", ".join(f"{f.architecture} ({f.model_type})" for f in FAMILIES.values())
    return f"{causal}; and each one's *{SEQ_CLS_SUFFIX} with num_labels=1 as a reward model"


def _family(config: Mapping[str, Any], source: str) -> Family:
    """The family of a config's `model_type`, which must list (in `architectures`, where present) only that
    family's causal LM or sequence-classification class: another class of a known model_type has other
    weights (e.g. Qwen2.5-Math-RM's Qwen2ForRewardModel, model_type qwen2, has a two-layer score head)."""
    model_type = config.get("model_type")
    architectures = [str(a) for a in config.get("architectures") or []]
    named = f"`model_type`={model_type!r}"
    if architectures:
        named = f"architecture {', '.join(architectures)} ({named})"
    if model_type in GATED_DELTA_NET_MODEL_TYPES:
        raise ConversionError(f"{source}: {named}: {GATED_DELTA_NET_BLOCKER}")
    family = FAMILIES.get(model_type)
    allowed = () if family is None else (family.architecture,
                                         family.architecture.removesuffix("ForCausalLM") + SEQ_CLS_SUFFIX)
    if family is None or any(a not in allowed for a in architectures):
        raise ConversionError(f"{source}: {named} is not supported: megarl maps these HF architectures onto "
                              f"megatron-core: {supported_architectures()}")
    return family


def arch_from_hf_config(config: Mapping[str, Any], source: str = "config.json") -> ModelArch:
    """Translate an HF config (the dict of `config.json`) into a `ModelArch`.

    Raises `ConversionError` naming `source` and the field for anything unsupported.
    """
    family = _family(config, source)
    model_type = family.model_type
    if config.get("quantization_config") and model_type == "gpt_oss":
        method = (config["quantization_config"] or {}).get("quant_method")
        raise ConversionError(f"{source}: `quantization_config` ({method}) is set; quantized gpt-oss checkpoints "
                              f"are not supported: {GPT_OSS_DEQUANTIZE}")
    if config.get("quantization_config"):
        raise ConversionError(f"{source}: `quantization_config` is set; quantized checkpoints are not supported")
    for key in family.must_be_false:
        if config.get(key):
            raise ConversionError(f"{source}: `{key}`=true is not supported for model_type {model_type!r}")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{source}: `hidden_act`={act!r} is not supported (only 'silu', i.e. SwiGLU)")
    layer_types = config.get("layer_types") or []
    if model_type != "gpt_oss" and any(t != "full_attention" for t in layer_types):
        raise ConversionError(f"{source}: `layer_types` other than 'full_attention' are not supported: {layer_types}")

    hidden = _positive_int(config, "hidden_size", source)
    heads = _positive_int(config, "num_attention_heads", source)
    groups = config.get("num_key_value_heads") or heads
    if family.mla and groups != heads:  # HF's MLA repeats keys num_attention_heads // num_key_value_heads times
        raise ConversionError(f"{source}: `num_key_value_heads`={groups} must equal `num_attention_heads`={heads} "
                              "with multi-latent attention (every head has its own key and value)")
    if not isinstance(groups, int) or groups <= 0 or heads % groups:
        raise ConversionError(
            f"{source}: `num_key_value_heads`={groups!r} must divide `num_attention_heads`={heads}"
        )
    head_dim = config.get("head_dim")
    mla = _mla(config, source) if family.mla else None
    if mla is not None:
        groups, head_dim = heads, mla.v_head_dim  # megatron's kv_channels: the attention output per head
    elif head_dim is None:
        if hidden % heads:
            raise ConversionError(
                f"{source}: `head_dim` is absent and `hidden_size`={hidden} is not a multiple of "
                f"`num_attention_heads`={heads}"
            )
        head_dim = hidden // heads
    elif not isinstance(head_dim, int) or head_dim <= 0:
        raise ConversionError(f"{source}: `head_dim` must be a positive integer, got {head_dim!r}")
    theta, scaling = _rope(config, source, yarn=family.mla or model_type == "gpt_oss", mla=family.mla,
                           partial_ok=family.partial_rotary)
    qkv_bias = bool(config.get(family.qkv_bias_key, False)) if family.qkv_bias_key else family.qkv_bias
    qk_norm = bool(config.get(family.qk_norm_key, False)) if family.qk_norm_key else family.qk_layernorm
    if family.moe == "qwen" and family.qkv_bias and config.get("qkv_bias") is False:
        raise ConversionError(f"{source}: `qkv_bias`=false is not supported for model_type {model_type!r}")
    window = config.get("sliding_window") if family.sliding_window_field else None
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise ConversionError(f"{source}: `sliding_window` must be a positive integer or null, got {window!r}")
    extra = gpt_oss_fields(config, source) if model_type == "gpt_oss" else {}
    window = extra.pop("sliding_window", window)
    return ModelArch(
        model_type=model_type,
        num_layers=_positive_int(config, "num_hidden_layers", source),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        ffn_hidden_size=_positive_int(config, "intermediate_size", source),
        vocab_size=_positive_int(config, "vocab_size", source),
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_positive_int(config, "max_position_embeddings", source),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
        sliding_window=window,
        rotary_percent=_partial_rotary(config, head_dim, source) if family.partial_rotary else 1.0,
        score_head=_score_head(config, source),
        moe=moe_from_hf_config(config, family.moe, source) if family.moe else None,
        mla=mla,
        mtp_layers=_mtp_layers(config, source) if family.mtp else 0,
        **extra,
    )


def _partial_rotary(config: Mapping[str, Any], head_dim: int, source: str) -> float:
    """HF's `partial_rotary_factor` as megatron's `rotary_percent`: both rotate the leading
    int(head_dim * factor) dims of each head with rotate_half (HF Glm4MoeRotaryEmbedding /
    `apply_rotary_pos_emb`; megatron RotaryEmbedding dim = int(kv_channels * rotary_percent)), which must be even."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1 or int(head_dim * factor) % 2:
        raise ConversionError(f"{source}: `partial_rotary_factor`={factor!r} must be in (0, 1] and rotate an even "
                              f"number of the {head_dim} head dims")
    return float(factor)


def _mtp_layers(config: Mapping[str, Any], source: str) -> int:
    value = config.get("num_nextn_predict_layers", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConversionError(f"{source}: `num_nextn_predict_layers` must be a non-negative integer, got {value!r}")
    return value


GPT_OSS_SWIGLU_ALPHA = 1.702  # megatron's quick_gelu hard-codes it (fusions/fused_bias_geglu.py `quick_gelu`)
GPT_OSS_DEQUANTIZE = ("dequantize it first: GptOssForCausalLM.from_pretrained(path, quantization_config="
                      "Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(out)")


def gpt_oss_fields(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `ModelArch` fields of a gpt-oss config beyond the common decoder's (transformers 5.25
    `GptOssConfig`), refusing what megatron-core cannot express: megatron adds biases to every linear
    or none (`add_bias_linear`), so `attention_bias` must be true (the experts and router always have
    them); its clamped GLU is quick_gelu, sigmoid gain 1.702 only."""
    if config.get("attention_bias", True) is not True:
        raise ConversionError(f"{source}: `attention_bias`={config['attention_bias']!r} is not supported for gpt_oss "
                              "(megatron-core biases every linear or none; the experts and router have biases)")
    alpha = config.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)
    if alpha != GPT_OSS_SWIGLU_ALPHA:
        raise ConversionError(f"{source}: `swiglu_alpha`={alpha!r} is not supported (megatron-core's quick_gelu "
                              f"hard-codes {GPT_OSS_SWIGLU_ALPHA})")
    limit = config.get("swiglu_limit", 7.0)
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or limit <= 0:
        raise ConversionError(f"{source}: `swiglu_limit` must be a positive number, got {limit!r}")
    layers = config.get("num_hidden_layers")
    types = list(config.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers or 0)])
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConversionError(f"{source}: `layer_types` must name 'sliding_attention' or 'full_attention' for each "
                              f"of the {layers} layers, got {types}")
    window = config.get("sliding_window")
    sliding = tuple(t == "sliding_attention" for t in types)
    if any(sliding) and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ConversionError(f"{source}: `sliding_window` must be a positive integer where `layer_types` has "
                              f"sliding layers, got {window!r}")
    return dict(sliding_window=window if any(sliding) else None, window_layers=sliding, attention_sinks=True,
                linear_bias=True, swiglu_clamp=float(limit))
