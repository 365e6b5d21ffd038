"""HF <-> megatron-core parameter mapping: declarative name rules plus pure tensor transforms.

Megatron names here are *global* (layer index over the whole model) and use the
transformer-engine spelling, which is also the spelling of `torch_dist` checkpoints, and MoE
experts are spelled as megatron's SequentialMLP names them (`mlp.experts.local_experts.<e>.linear_fc1.weight`).
Names from a live local-spec model (`input_layernorm`, `pre_mlp_layernorm`), grouped-GEMM experts
(`mlp.experts.linear_fc1.weight<e>`, `megarl.bridge.grouped_experts`) and names wrapped in `module.`
prefixes are accepted everywhere and canonicalised by `canonical_name`.

`WeightMap(arch, padded_vocab_size)` turns one megatron name + its full (TP-gathered) tensor into
its HF tensors (`to_hf`) and back (`to_mcore`). Both are pure, one parameter at a time, so the
offline converters and the live resharder stream a layer at a time with them.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable, Literal, Optional

import torch

from megarl.bridge.arch import ModelArch
from megarl.bridge.errors import ConversionError
from megarl.bridge.grouped_experts import sequential_expert_name
from megarl.bridge.moe import expert_index, hf_expert, hf_router
from megarl.bridge.moe import hf_shape as moe_hf_shape
from megarl.bridge.transforms import merge_gate_up, merge_qkv, pad_vocab, split_gate_up, split_qkv, unpad_vocab


@dataclass(frozen=True)
class TPSplit:
    """How megatron splits a full tensor across tensor-parallel ranks."""

    dim: Optional[int]  # None: every rank holds the full tensor
    stride: int = 1  # 2: the two halves ([gate; up]) are split separately, rank k holds [gate_k; up_k]


COLUMN, ROW, REPLICATED, GLU_COLUMN = TPSplit(0), TPSplit(1), TPSplit(None), TPSplit(0, stride=2)

Transform = Literal["identity", "qkv", "gate_up", "vocab"]
Condition = Literal["always", "gqa", "qkv_bias", "qk_layernorm", "untied", "score_head", "dense_mlp", "moe_qwen",
                    "moe_mixtral", "moe_gpt_oss", "moe_deepseek", "moe", "shared_expert", "shared_experts",
                    "expert_bias", "mla", "mla_q", "mla_q_lora", "linear_bias", "attention_sinks", "mtp"]
# conditions of a dense layer's MLP and of an MoE layer's (`ModelArch.is_moe_layer` says which a layer is)
DENSE_LAYER_CONDITIONS = ("dense_mlp",)
MOE_LAYER_CONDITIONS = ("moe", "moe_qwen", "moe_mixtral", "moe_gpt_oss", "moe_deepseek", "shared_expert",
                        "shared_experts", "expert_bias")


@dataclass(frozen=True)
class ParamRule:
    mcore: str  # global megatron name, TE spelling; "{i}" is the layer index, "{e}" the (global) expert index
    hf: tuple[str, ...]  # HF names in the order `transform` produces them; "{i}" layer, "{e}" expert
    transform: Transform
    tp: TPSplit
    condition: Condition = "always"
    local_alias: Optional[str] = None  # local-spec (non-TE) spelling of `mcore`

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.mcore

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.mcore

    def for_expert(self, e: int) -> "ParamRule":
        """This rule with the expert index `e` filled in (names keep their "{i}")."""
        return replace(self, mcore=self.mcore.replace("{e}", str(e)), hf=tuple(h.replace("{e}", str(e)) for h in self.hf))

    def applies(self, arch: ModelArch, layer: Optional[int] = None) -> bool:
        """The rule names a tensor of `arch` (at layer `layer`, where given: dense and MoE layers differ; the
        multi-token-prediction layers are layers `arch.num_layers` on, `mtp_as_decoder`)."""
        if self.condition == "mtp":
            return arch.mtp_layers > 0 and (layer is None or layer >= arch.num_layers)
        if layer is not None:
            if self.condition in DENSE_LAYER_CONDITIONS and arch.is_moe_layer(layer):
                return False
            if self.condition in MOE_LAYER_CONDITIONS and not arch.is_moe_layer(layer):
                return False
        moe, mla = arch.moe, arch.mla
        return {
            "always": True,
            "gqa": mla is None,
            "mla": mla is not None,
            "mla_q": mla is not None and mla.q_lora_rank is None,
            "mla_q_lora": mla is not None and mla.q_lora_rank is not None,
            "qkv_bias": arch.qkv_bias,
            "qk_layernorm": arch.qk_layernorm,
            "untied": not arch.tie_word_embeddings and not arch.score_head,
            "score_head": arch.score_head,
            "dense_mlp": arch.has_dense_layers,
            "moe": moe is not None,
            "moe_qwen": moe is not None and moe.scheme == "qwen",
            "moe_mixtral": moe is not None and moe.scheme == "mixtral",
            "moe_gpt_oss": moe is not None and moe.scheme == "gpt_oss",
            "linear_bias": arch.linear_bias,
            "attention_sinks": arch.attention_sinks,
            "moe_deepseek": moe is not None and moe.scheme == "deepseek",
            "shared_expert": moe is not None and moe.shared_expert and moe.scheme == "qwen",
            "shared_experts": moe is not None and moe.shared_expert and moe.scheme == "deepseek",
            "expert_bias": moe is not None and moe.expert_bias,
        }[self.condition]


_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
SCORE = "score.weight"  # HF *ForSequenceClassification head, [num_labels, H]
RULES: tuple[ParamRule, ...] = (
    ParamRule(EMBEDDING, ("model.embed_tokens.weight",), "vocab", COLUMN),
    ParamRule(_L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",), "identity",
              REPLICATED, "gqa", local_alias=_L + "input_layernorm.weight"),
    ParamRule(_L + "self_attention.linear_qkv.weight",
              tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", COLUMN, "gqa"),
    ParamRule(_L + "self_attention.linear_qkv.bias",
              tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv", COLUMN, "qkv_bias"),
    ParamRule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), "identity", REPLICATED,
              "qk_layernorm"),
    ParamRule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), "identity", REPLICATED,
              "qk_layernorm"),
    ParamRule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), "identity", ROW),
    # gpt-oss: o_proj's bias (added once, after the row-parallel reduction) and the per-head sink logits
    ParamRule(_L + "self_attention.linear_proj.bias", (_H + "self_attn.o_proj.bias",), "identity", REPLICATED,
              "linear_bias"),
    ParamRule(_L + "self_attention.core_attention.softmax_offset", (_H + "self_attn.sinks",), "identity", COLUMN,
              "attention_sinks"),
    ParamRule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",), "identity",
              REPLICATED, "dense_mlp", local_alias=_L + "pre_mlp_layernorm.weight"),
    ParamRule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up",
              GLU_COLUMN, "dense_mlp"),
    ParamRule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "identity", ROW, "dense_mlp"),
    # MoE layers (megarl.bridge.moe): a separate pre-MLP norm, a router, experts, maybe a shared expert.
    # Expert splits are over expert-TP ranks (the sharding functions use ETP for them).
    ParamRule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "identity", REPLICATED,
              "moe"),
    *(
        rule
        for scheme in ("qwen", "mixtral", "gpt_oss", "deepseek")
        for rule in (
            ParamRule(_L + "mlp.router.weight", (hf_router(scheme),), "identity", REPLICATED, f"moe_{scheme}"),
            ParamRule(_L + "mlp.experts.local_experts.{e}.linear_fc1.weight",
                      (hf_expert(scheme, "gate"), hf_expert(scheme, "up")), "gate_up", GLU_COLUMN, f"moe_{scheme}"),
            ParamRule(_L + "mlp.experts.local_experts.{e}.linear_fc2.weight", (hf_expert(scheme, "down"),),
                      "identity", ROW, f"moe_{scheme}"),
        )
    ),
    # gpt-oss's biases (its experts read per expert from the fused tensors: megarl.bridge.fused_experts);
    # megatron allows expert biases only at expert TP 1 (transformer_config.py), so they are never split
    ParamRule(_L + "mlp.router.bias", (hf_router("gpt_oss", "bias"),), "identity", REPLICATED, "moe_gpt_oss"),
    ParamRule(_L + "mlp.experts.local_experts.{e}.linear_fc1.bias",
              (hf_expert("gpt_oss", "gate", "bias"), hf_expert("gpt_oss", "up", "bias")), "gate_up", GLU_COLUMN,
              "moe_gpt_oss"),
    ParamRule(_L + "mlp.experts.local_experts.{e}.linear_fc2.bias", (hf_expert("gpt_oss", "down", "bias"),),
              "identity", REPLICATED, "moe_gpt_oss"),
    *(
        rule
        for hf, condition in (("shared_expert", "shared_expert"), ("shared_experts", "shared_experts"))
        for rule in (
            ParamRule(_L + "mlp.shared_experts.linear_fc1.weight",
                      (_H + f"mlp.{hf}.gate_proj.weight", _H + f"mlp.{hf}.up_proj.weight"), "gate_up",
                      GLU_COLUMN, condition),
            ParamRule(_L + "mlp.shared_experts.linear_fc2.weight", (_H + f"mlp.{hf}.down_proj.weight",), "identity",
                      ROW, condition),
        )
    ),
    ParamRule(_L + "mlp.shared_experts.gate_weight", (_H + "mlp.shared_expert_gate.weight",), "identity",
              REPLICATED, "shared_expert"),
    # DeepSeek-V3's router bias for expert selection (megatron's expert_bias buffer, float32 in both)
    ParamRule(_L + "mlp.router.expert_bias", (_H + "mlp.gate.e_score_correction_bias",), "identity", REPLICATED,
              "expert_bias"),
    # multi-latent attention (megarl.bridge.arch.MLASpec). The pre-attention norm is a layer norm of its own.
    # The down projections are column-parallel in megatron's local spec; megarl's transformer-engine MLA
    # spec makes them column-parallel too (megatron_config.layer_spec), so one split serves both.
    ParamRule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), "identity", REPLICATED, "mla"),
    ParamRule(_L + "self_attention.linear_q_proj.weight", (_H + "self_attn.q_proj.weight",), "identity", COLUMN,
              "mla_q"),
    ParamRule(_L + "self_attention.linear_q_down_proj.weight", (_H + "self_attn.q_a_proj.weight",), "identity",
              COLUMN, "mla_q_lora"),
    ParamRule(_L + "self_attention.linear_q_up_proj.layer_norm_weight", (_H + "self_attn.q_a_layernorm.weight",),
              "identity", REPLICATED, "mla_q_lora", local_alias=_L + "self_attention.q_layernorm.weight"),
    ParamRule(_L + "self_attention.linear_q_up_proj.weight", (_H + "self_attn.q_b_proj.weight",), "identity",
              COLUMN, "mla_q_lora"),
    ParamRule(_L + "self_attention.linear_kv_down_proj.weight", (_H + "self_attn.kv_a_proj_with_mqa.weight",),
              "identity", COLUMN, "mla"),
    ParamRule(_L + "self_attention.linear_kv_up_proj.layer_norm_weight", (_H + "self_attn.kv_a_layernorm.weight",),
              "identity", REPLICATED, "mla", local_alias=_L + "self_attention.kv_layernorm.weight"),
    ParamRule(_L + "self_attention.linear_kv_up_proj.weight", (_H + "self_attn.kv_b_proj.weight",), "identity",
              COLUMN, "mla"),
    # a multi-token-prediction layer's own tensors (megatron-core transformer/multi_token_prediction.py
    # MultiTokenPredictionLayer: enorm, hnorm, eh_proj [H, 2H] column-parallel, final_layernorm), spelled as
    # decoder layers `num_layers + k` (`mtp_as_decoder`); its transformer layer uses the decoder layers' rules
    ParamRule(_L + "enorm.weight", (_H + "enorm.weight",), "identity", REPLICATED, "mtp"),
    ParamRule(_L + "hnorm.weight", (_H + "hnorm.weight",), "identity", REPLICATED, "mtp"),
    ParamRule(_L + "eh_proj.weight", (_H + "eh_proj.weight",), "identity", COLUMN, "mtp"),
    ParamRule(_L + "final_layernorm.weight", (_H + "shared_head.norm.weight",), "identity", REPLICATED, "mtp"),
    ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "identity", REPLICATED),
    ParamRule(OUTPUT_LAYER, ("lm_head.weight",), "vocab", COLUMN, "untied"),
    # a reward model's scalar head takes the output layer's place, whole on every TP rank
    ParamRule(OUTPUT_LAYER, (SCORE,), "identity", REPLICATED, "score_head"),
)

# HF tensors that carry no parameter of their own
HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# A checkpoint's copies of the embedding and LM head in each MTP layer: megatron's MTP layers use the model's
# own (GPTModel passes `embedding` and its `output_layer`), and SGLang's draft model skips them too, taking the
# target's ("Use shared head and embed weights from target model": models/deepseek_common/deepseek_weight_loader.py)
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")
MTP_OWN = ("enorm", "hnorm", "eh_proj", "final_layernorm")  # MultiTokenPredictionLayer's modules besides its layer
# an MTP layer's decoder layer: `transformer_layer` in megatron-core 0.16, `mtp_model_layer` in 0.19
# (MultiTokenPredictionLayerSubmodules); the bridge spells it as 0.16 does and reads both
_MTP_NAME = re.compile(r"^mtp\.layers\.(\d+)\.((?:transformer_layer|mtp_model_layer)\.)?(.+)$")
_DECODER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def mtp_as_decoder(name: str, first_layer: int) -> Optional[str]:
    """The megatron MTP name `mtp.layers.{k}.transformer_layer.<rest>` (or `.mtp_model_layer.`) or
    `mtp.layers.{k}.<own>` (`MTP_OWN`)
    spelled as decoder layer `first_layer + k`: `decoder.layers.{first_layer + k}.<rest>`, so that the decoder
    rules name its HF tensors (DeepSeek-V3 / GLM-4.5 store MTP layer k as `model.layers.{num_hidden_layers + k}`:
    `first_layer` is `arch.num_layers`). None for a name outside the MTP block."""
    m = _MTP_NAME.match(strip_module_prefix(name))
    if m is None:
        return None
    k, in_layer, rest = int(m.group(1)), m.group(2), m.group(3)
    if (in_layer is None) != (rest.split(".", 1)[0] in MTP_OWN):
        raise ConversionError(f"megatron parameter {name!r} has no HF mapping")
    return f"decoder.layers.{first_layer + k}.{rest}"


def decoder_as_mtp(name: str, first_layer: int) -> str:
    """The inverse of `mtp_as_decoder`: `decoder.layers.{first_layer + k}.<rest>` -> the MTP name."""
    m = _DECODER_NAME.match(name)
    k, rest = int(m.group(1)) - first_layer, m.group(2)
    return f"mtp.layers.{k}.{rest}" if rest.split(".", 1)[0] in MTP_OWN else f"mtp.layers.{k}.transformer_layer.{rest}"


def _pattern(template: str) -> re.Pattern:
    escaped = re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)").replace(re.escape("{e}"), r"(?P<e>\d+)")
    return re.compile(escaped + "$")


# MoE and MLA rules last: without an arch, `pre_mlp_layernorm` is the dense local alias and
# `input_layernorm` the fused qkv norm's (`canonical_name`)
_MOE_CONDITIONS = MOE_LAYER_CONDITIONS + ("mla", "mla_q", "mla_q_lora")
_MCORE_PATTERNS = (
    [(_pattern(r.mcore), r) for r in RULES if r.condition not in _MOE_CONDITIONS]
    + [(_pattern(r.local_alias), r) for r in RULES if r.local_alias]
    + [(_pattern(r.mcore), r) for r in RULES if r.condition in _MOE_CONDITIONS]
)


def is_extra_state(name: str) -> bool:
    """transformer-engine / megatron `_extra_state` entries: metadata, not parameters."""
    return name.endswith("._extra_state") or "._extra_state/" in name


@functools.lru_cache(maxsize=65536)
def _matching_rules(name: str) -> tuple[tuple[ParamRule, Optional[int]], ...]:
    """Every rule matching the megatron name `name`, with its layer index. Memoised (pure; the
    rules are frozen): a weight push plans its buckets again each time and asks this for every
    parameter several times, ~30 regular expressions each (0.6 ms of the CPU quickstart push's
    2.5 ms stream, tools/bench/push_profile.py)."""
    bare = sequential_expert_name(strip_module_prefix(name))  # grouped-GEMM experts: their sequential name
    bare = mtp_as_decoder(bare, 0) or bare  # an MTP layer's rule is its decoder twin's (layer index k here)
    found = []
    for pattern, rule in _MCORE_PATTERNS:
        m = pattern.match(bare)
        if m:
            bound = rule.for_expert(int(m.group("e"))) if rule.per_expert else rule
            found.append((bound, int(m.group("i")) if rule.per_layer else None))
    if not found:
        raise ConversionError(f"megatron parameter {name!r} has no HF mapping")
    return tuple(found)


def match_mcore(name: str) -> tuple[ParamRule, Optional[int]]:
    """The rule of a megatron name (TE or local spelling, any `module.` prefix) and its layer
    index. `output_layer.weight` gets the LM head's rule; `WeightMap` knows when it is a score head."""
    return _matching_rules(name)[0]


def strip_module_prefix(name: str) -> str:
    """Drop the `module.` prefixes added by DDP / Float16Module wrappers."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def canonical_name(name: str) -> str:
    """The TE spelling of a megatron name: `module.` prefixes dropped, local-spec norm names renamed,
    grouped-GEMM experts named as SequentialMLP names them; an MTP layer's names stay in the MTP block."""
    rule, layer = match_mcore(name)
    canonical = rule.mcore.format(i=layer)
    return canonical if mtp_as_decoder(name, 0) is None else decoder_as_mtp(canonical, 0)


def tp_split(name: str) -> TPSplit:
    """How the megatron parameter `name` is split across tensor-parallel ranks."""
    return match_mcore(name)[0].tp


@dataclass(frozen=True)
class WeightMap:
    """All HF <-> megatron tensor conversions of one model, one parameter at a time.

    `padded_vocab_size` is the row count of megatron's embedding and output layer (see
    `transforms.padded_vocab_size`); HF tensors have `arch.vocab_size` rows. `mtp`: the megatron model
    has the checkpoint's `arch.mtp_layers` multi-token-prediction layers (`GPTModel(mtp_block_spec=...)`,
    names `mtp.layers.{k}.*`), which map to HF's `model.layers.{arch.num_layers + k}.*`; without it
    they are left out, as transformers' DeepseekV3ForCausalLM leaves them.
    """

    arch: ModelArch
    padded_vocab_size: int
    mtp: bool = False

    def __post_init__(self):
        if self.padded_vocab_size < self.arch.vocab_size:
            raise ConversionError(
                f"padded vocabulary {self.padded_vocab_size} is smaller than vocab_size {self.arch.vocab_size}"
            )
        if self.mtp and not self.arch.mtp_layers:
            raise ConversionError(f"this {self.arch.model_type} config has no multi-token-prediction layers "
                                  "(num_nextn_predict_layers is 0 or absent)")

    # ---------------------------------------------------------------- names
    def rules(self) -> list[ParamRule]:
        return [r for r in RULES if r.applies(self.arch)]

    def mcore_names(self) -> list[str]:
        """Every global megatron parameter name (TE spelling), in checkpoint order: embedding,
        layer 0 .. L-1 (MoE experts by global index), final norm, output layer (absent when tied)."""
        experts = range(self.arch.moe.num_experts) if self.arch.moe else ()
        layer_rules = [b for r in self.rules() if r.per_layer for b in ([r.for_expert(e) for e in experts]
                                                                        if r.per_expert else [r])]
        per_layer = [r.mcore.format(i=i) for i in range(self.arch.num_layers) for r in layer_rules
                     if r.applies(self.arch, i)]
        after = [r.mcore for r in self.rules() if not r.per_layer and r.mcore != EMBEDDING]
        first = self.arch.num_layers
        mtp = [decoder_as_mtp(r.mcore.format(i=i), first) for i in range(first, first + self.mtp_layers)
               for r in layer_rules if r.applies(self.arch, i)]
        return [EMBEDDING, *per_layer, *after, *mtp]

    @property
    def mtp_layers(self) -> int:
        """Multi-token-prediction layers the megatron model holds: the checkpoint's with `mtp`, else 0."""
        return self.arch.mtp_layers if self.mtp else 0

    def mtp_copies(self) -> dict[str, str]:
        """{HF name of an MTP layer's copy of the embedding or LM head (`MTP_SHARED_COPIES`): the HF name of the
        main model's tensor it copies}, for the `mtp_layers` the megatron model holds. Hub checkpoints store them
        (DeepSeek-V3's `model.layers.61.embed_tokens.weight` / `shared_head.head.weight`); megatron's MTP layers
        use the model's own, so the converter checks they are copies and writes them back from those."""
        head = "model.embed_tokens.weight" if self.arch.lm_head_tied else "lm_head.weight"
        first = self.arch.num_layers
        return {f"model.layers.{i}.{copy}": main for i in range(first, first + self.mtp_layers)
                for copy, main in zip(MTP_SHARED_COPIES, ("model.embed_tokens.weight", head))}

    def hf_names(self) -> list[str]:
        """Every HF parameter name, in the order of `mcore_names` (no `mtp_copies`)."""
        return [h for name in self.mcore_names() for h in self.hf_names_of(name)]

    def hf_names_of(self, mcore_name: str) -> tuple[str, ...]:
        rule, layer = self._rule(mcore_name)
        return tuple(h.format(i=layer) for h in rule.hf)

    def is_tied_output_copy(self, mcore_name: str) -> bool:
        """True for the last pipeline stage's copy of a tied embedding: it is never exported."""
        return self.arch.lm_head_tied and strip_module_prefix(mcore_name) == OUTPUT_LAYER

    def tp_split(self, mcore_name: str) -> TPSplit:
        """How `mcore_name` is split across TP ranks in this model (a score head is replicated);
        for an expert, across expert-TP ranks."""
        return self._rule(mcore_name)[0].tp

    def canonical(self, mcore_name: str) -> str:
        """The global TE spelling of `mcore_name` in this model (`canonical_name`, but an MoE
        layer's `pre_mlp_layernorm` stays itself). A tied output-layer copy keeps its name."""
        if self.is_tied_output_copy(mcore_name):
            return OUTPUT_LAYER
        rule, layer = self._rule(mcore_name)
        canonical = rule.mcore.format(i=layer)
        first = self.arch.num_layers
        return canonical if layer is None or layer < first else decoder_as_mtp(canonical, first)

    def _rule(self, mcore_name: str) -> tuple[ParamRule, Optional[int]]:
        """The rule of `mcore_name` and its layer index: an MTP layer k's is `arch.num_layers + k`."""
        first = self.arch.num_layers
        decoder = mtp_as_decoder(mcore_name, first)
        if decoder is not None and not self.mtp:
            raise ConversionError(f"megatron parameter {mcore_name!r}: a multi-token-prediction layer, and this "
                                  "model is mapped without them (WeightMap.mtp)")
        matches = [(r, i) for r, i in _matching_rules(decoder or mcore_name) if r.applies(self.arch, i)]
        if not matches:
            raise ConversionError(f"megatron parameter {mcore_name!r} does not exist in this {self.arch.model_type} config")
        rule, layer = matches[0]
        if decoder is None and layer is not None and layer >= first:
            raise ConversionError(f"megatron parameter {mcore_name!r}: layer {layer} >= num_layers {first}")
        if decoder is not None and layer >= first + self.arch.mtp_layers:
            raise ConversionError(f"megatron parameter {mcore_name!r}: MTP layer {layer - first} >= "
                                  f"num_nextn_predict_layers {self.arch.mtp_layers}")
        e = expert_index(mcore_name)
        if e is not None:
            if e >= self.arch.moe.num_experts:
                raise ConversionError(f"megatron parameter {mcore_name!r}: expert {e} >= num_experts {self.arch.moe.num_experts}")
        return rule, layer

    # ---------------------------------------------------------------- shapes
    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """The shape `arch` gives the HF tensor `hf_name` (one of `hf_names()`)."""
        a = self.arch
        d, hid = a.kv_channels, a.hidden_size
        if a.moe is not None:
            shape = moe_hf_shape(a.moe, hid, hf_name)
            if shape is not None:
                return shape
        suffix = hf_name.rsplit(".", 2)[-2:]
        if a.mla is not None:
            m = a.mla
            mla_shapes = {
                ("q_proj", "weight"): (a.num_attention_heads * m.q_head_dim, hid),
                ("q_a_proj", "weight"): (m.q_lora_rank, hid),
                ("q_a_layernorm", "weight"): (m.q_lora_rank,),
                ("q_b_proj", "weight"): (a.num_attention_heads * m.q_head_dim, m.q_lora_rank),
                ("kv_a_proj_with_mqa", "weight"): (m.kv_lora_rank + m.qk_rope_head_dim, hid),
                ("kv_a_layernorm", "weight"): (m.kv_lora_rank,),
                ("kv_b_proj", "weight"): (a.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            }
            if tuple(suffix) in mla_shapes:
                return mla_shapes[tuple(suffix)]
        shapes = {
            ("embed_tokens", "weight"): (a.vocab_size, hid),
            ("lm_head", "weight"): (a.vocab_size, hid),
            ("score", "weight"): (1, hid),
            ("q_proj", "weight"): (a.num_attention_heads * d, hid),
            ("k_proj", "weight"): (a.num_query_groups * d, hid),
            ("v_proj", "weight"): (a.num_query_groups * d, hid),
            ("q_proj", "bias"): (a.num_attention_heads * d,),
            ("k_proj", "bias"): (a.num_query_groups * d,),
            ("v_proj", "bias"): (a.num_query_groups * d,),
            ("q_norm", "weight"): (d,),
            ("k_norm", "weight"): (d,),
            ("o_proj", "weight"): (hid, a.num_attention_heads * d),
            ("self_attn", "sinks"): (a.num_attention_heads,),
            ("gate_proj", "weight"): (a.ffn_hidden_size, hid),
            ("up_proj", "weight"): (a.ffn_hidden_size, hid),
            ("down_proj", "weight"): (hid, a.ffn_hidden_size),
            ("eh_proj", "weight"): (hid, 2 * hid),
        }
        return shapes.get(tuple(suffix), (hid,))  # the remaining ones are the hidden-size norms

    def mcore_shape(self, mcore_name: str) -> tuple[int, ...]:
        """Full (unsharded) shape of a megatron parameter."""
        rule, _ = self._rule(mcore_name)
        hf_shapes = [self.hf_shape(h) for h in self.hf_names_of(mcore_name)]
        if rule.transform == "vocab":
            return (self.padded_vocab_size, *hf_shapes[0][1:])
        if rule.transform == "identity":
            return hf_shapes[0]
        return (sum(s[0] for s in hf_shapes), *hf_shapes[0][1:])

    # ---------------------------------------------------------------- tensors
    def to_hf(self, mcore_name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One full (TP-gathered) megatron tensor -> its HF (name, tensor) pairs."""
        _check_shape(mcore_name, full, self.mcore_shape(mcore_name))
        return list(zip(self.hf_names_of(mcore_name), self._split(mcore_name, full)))

    def hf_rows(self, mcore_name: str) -> list[tuple[str, torch.Tensor]]:
        """Which rows (dim 0) of the full megatron tensor each HF tensor is, in order: (HF name,
        int64 row indices [HF rows]). Every transform is a row selection, so an HF tensor can be
        written straight from the TP shards that hold its rows (the resharder does)."""
        rows = self.mcore_shape(mcore_name)[0]
        return [(name, part.reshape(-1)) for name, part in
                zip(self.hf_names_of(mcore_name), self._split(mcore_name, torch.arange(rows).unsqueeze(1)))]

    def _split(self, mcore_name: str, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`full` [rows, ...] cut into its HF tensors (`to_hf`; `hf_rows` with a column of row indices)."""
        rule, _ = self._rule(mcore_name)
        a = self.arch
        if rule.transform == "qkv":
            return split_qkv(full, a.num_attention_heads, a.num_query_groups, a.kv_channels)
        if rule.transform == "gate_up":
            return split_gate_up(full)
        if rule.transform == "vocab":
            return (unpad_vocab(full, a.vocab_size),)
        return (full,)

    def to_mcore(self, mcore_name: str, read_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The full megatron tensor `mcore_name`, built from the HF tensors `read_hf(name)` returns."""
        rule, _ = self._rule(mcore_name)
        parts = []
        for hf_name in self.hf_names_of(mcore_name):
            tensor = read_hf(hf_name)
            _check_shape(hf_name, tensor, self.hf_shape(hf_name))
            parts.append(tensor)
        a = self.arch
        if rule.transform == "qkv":
            return merge_qkv(*parts, a.num_attention_heads, a.num_query_groups, a.kv_channels)
        if rule.transform == "gate_up":
            return merge_gate_up(*parts)
        if rule.transform == "vocab":
            return pad_vocab(parts[0], self.padded_vocab_size)
        return parts[0]

    @cached_property
    def _hf_set(self) -> frozenset[str]:
        return frozenset(self.hf_names())

    def is_mtp_tensor(self, hf_name: str) -> bool:
        """`hf_name` belongs to one of the checkpoint's `arch.mtp_layers` MTP layers (`model.layers.{L + k}.*`)."""
        m = _HF_LAYER.match(hf_name)
        return m is not None and 0 <= int(m.group(1)) - self.arch.num_layers < self.arch.mtp_layers

    def _is_ignored_mtp(self, hf_name: str) -> bool:
        """A tensor of the checkpoint's MTP layers that the megatron model does not hold: any of them
        without `mtp`, their copies of the embedding and LM head (`MTP_SHARED_COPIES`) with it."""
        return self.is_mtp_tensor(hf_name) and (not self.mtp or hf_name.split(".", 3)[3] in MTP_SHARED_COPIES)

    def check_hf_names(self, names: set[str], source: str) -> None:
        """Every HF tensor a conversion needs is in `names`, and every tensor in `names` is used
        (a tied `lm_head.weight`, rotary `inv_freq` buffers and the tensors of DeepSeek-V3's
        multi-token-prediction layers, `arch.mtp_layers` after the last, that the megatron model does not
        hold, `_is_ignored_mtp`, are allowed and ignored)."""
        missing = [n for n in self.hf_names() if n not in names]
        if missing:
            raise ConversionError(f"{source}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}")
        unexpected = [
            n
            for n in sorted(names)
            if n not in self._hf_set
            and not HF_IGNORED.fullmatch(n)
            and not (n == "lm_head.weight" and self.arch.lm_head_tied)
            and not self._is_ignored_mtp(n)
        ]
        if unexpected:
            raise ConversionError(
                f"{source}: {len(unexpected)} tensor(s) have no megatron-core counterpart in this "
                f"{self.arch.model_type} config (an unsupported feature such as a bias on o_proj, or a layer "
                f"beyond num_hidden_layers), e.g. {unexpected[:3]}"
            )


_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ConversionError(f"{name}: shape {list(tensor.shape)} does not match the config's {list(expected)}")
