"""Rules on quantization-aware training (`actor_rollout_ref.actor.megatron.qat`, verl's engine/megatron.yaml
`qat`): NVFP4 W4A16 fake quantization of the actor's linears (megarl.engines.megatron.qat)."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

from megarl.config.fp8_training import fp8_format
from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig

log = logging.getLogger("megarl.config")
KEY = "actor_rollout_ref.actor.megatron.qat"
NVFP4_GROUP = 16  # NVFP4's group (verl engine/megatron.yaml qat.group_size: "NVFP4 requires 16")

# What the rollout servers get from a QAT actor, and why (megarl.sync.resharder `fake_quant`).
ROLLOUT_NVFP4_NOT_BUILT = (
    f"{KEY}.enable=true: the rollout servers get the actor's NVFP4 weights dequantized to the rollout dtype, so "
    "they compute with exactly the trainer's quantized values, but without NVFP4's memory and speed (serving "
    "NVFP4-packed weights is not built)")


def rollout_weights_format() -> str:
    """How a QAT actor's weights reach the rollout servers, on every device for now: "dequantized"
    (the NVFP4 values in the rollout dtype; "nvfp4", packed weights and scales, is not built). SGLang 0.5.23 serves NVFP4 checkpoints (`--quantization
    modelopt_fp4`) with srt/layers/quantization/modelopt_quant.py `ModelOptFp4LinearMethod`, whose
    `__init__` computes W4A4 (activations quantized too) unless SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16
    is set with flashinfer's CuTe-DSL FP4 GEMM backend, a Blackwell (capability 10.x) kernel; and it
    runs on no CPU. W4A16 multiplies bf16 activations by the dequantized weights anyway, so the
    dequantized push computes the same function on every device."""
    return "dequantized"


def qat_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """With the actor's QAT on: mode w4a16 (w4a4 quantizes activations, not built), group_size 16 (NVFP4's
    group), no LoRA on the
    actor (the push merges the adapters into the base weights, `engines.megatron.lora.merged`, and would
    quantize W + BA where the trainer computes quant(W) + BA), no FP8 training on the actor (QAT builds
    megatron's local linears, whose forward takes the fake-quantized weight, and those have no FP8 GEMM:
    `config.fp8_training`), nor grouped-GEMM experts (their weights are no local linear's); its
    `quantization_config_path` is read by the preflight
    (`quantization_config_problems`). The critic takes no QAT (verl would quantize it too: not built); the reference and the
    reward model are forward-only, which verl never quantizes (verl/workers/engine/megatron/transformer_impl.py:
    `if self._qat_enabled and not self.engine_config.forward_only`).

    Reads: actor_rollout_ref.actor.megatron.qat, actor_rollout_ref.model.lora.rank,
    actor_rollout_ref.actor.megatron.override_transformer_config, actor_rollout_ref.actor.megatron.moe_grouped_gemm,
    critic.megatron.qat.enable
    """
    if config.critic.megatron.qat.enable:
        yield ("critic.megatron.qat.enable=true: quantization-aware training of the critic is not built "
               f"(megarl quantizes the actor's weights only, {KEY})")
    qat = config.actor_rollout_ref.actor.megatron.qat
    if not qat.enable:
        return
    if qat.mode != "w4a16":
        yield (f"{KEY}.mode={qat.mode}: not built (W4A4 also quantizes the activations); megarl's QAT is w4a16, "
               "NVFP4 weights with full-precision activations")
    if qat.group_size != NVFP4_GROUP:
        yield f"{KEY}.group_size={qat.group_size}: NVFP4 requires 16 (its FP8 scale covers 16 FP4 weights)"
    if config.actor_rollout_ref.model.lora.rank > 0:
        yield (f"{KEY}.enable=true with actor_rollout_ref.model.lora.rank={config.actor_rollout_ref.model.lora.rank}: "
               "not built (the push merges the adapters into the base weights, whose NVFP4 values would then "
               "differ from the trainer's quantized base weights plus adapters)")
    if config.actor_rollout_ref.actor.megatron.moe_grouped_gemm:
        yield (f"{KEY}.enable=true with actor_rollout_ref.actor.megatron.moe_grouped_gemm=true: QAT quantizes "
               "megatron's local linears, and grouped-GEMM experts keep their weights outside them (not built); "
               "leave moe_grouped_gemm null (one MLP per expert, each quantized)")
    fp8 = fp8_format(config.actor_rollout_ref.actor.megatron.override_transformer_config)
    if fp8:
        yield (f"{KEY}.enable=true with actor_rollout_ref.actor.megatron.override_transformer_config.fp8={fp8}: "
               "QAT builds megatron's local linear layers (their forward takes the fake-quantized weight), which "
               "have no FP8 GEMM (transformer-engine's only); turn one off")


def quantization_config_problems(config: ExperimentConfig) -> list[str]:
    """The actor's `qat.quantization_config_path` (with QAT on), read before any process starts
    (megarl.trainer.preflight, as the other files a run reads): verl-recipe's
    qat/config/nvfp4_w4a16_megatron.json, {"quant_algo": "NVFP4", "config_groups": {name: {"weights":
    {"num_bits": 4, "type": "float", "group_size": 16, ...}, ...}}, ...}: NVFP4 in groups of `qat.group_size`.
    verl hands it to vLLM; megarl's servers get the dequantized weights, so nothing else of it is read."""
    qat = config.actor_rollout_ref.actor.megatron.qat
    if not qat.enable or qat.quantization_config_path is None:
        return []
    return list(_quantization_config_problems(qat.quantization_config_path, qat.group_size))


def _quantization_config_problems(path: str, group_size: int) -> Iterator[str]:
    key = f"{KEY}.quantization_config_path={path}"
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        yield f"{key}: no such file"
        return
    except (OSError, ValueError) as err:
        yield f"{key}: not a readable JSON file ({err})"
        return
    if not isinstance(spec, dict) or spec.get("quant_algo") != "NVFP4":
        algo = spec.get("quant_algo") if isinstance(spec, dict) else None
        yield f"{key}: quant_algo is {algo!r}, not \"NVFP4\" (megarl's QAT is NVFP4)"
        return
    groups = spec.get("config_groups") or {}
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        if (weights.get("num_bits"), weights.get("type"), weights.get("group_size")) != (4, "float", group_size):
            yield (f"{key}: config_groups.{name}.weights is {weights}, not NVFP4's 4-bit float in groups of "
                   f"{group_size} ({KEY}.group_size)")


def qat_warnings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Warnings (megarl.config.rules.WARNING_RULES): the reward model's `megatron.qat.enable` has no
    effect (verl quantizes trained engines only); with the actor's on, what the rollout servers get
    (`rollout_weights_format`), an `activation_observer` that w4a16 ignores (verl reads it for W4A4 only:
    verl/utils/qat/linear.py; its Megatron path, verl/utils/modelopt/quantize.py, never), and its
    `gradient_accumulation_fusion` override left out (megarl.engines.megatron.qat.transformer_overrides says why).

    Reads: reward_model.megatron.qat.enable, actor_rollout_ref.actor.megatron.qat.enable,
    actor_rollout_ref.actor.megatron.override_transformer_config
    """
    if config.reward_model.megatron.qat.enable:
        yield ("reward_model.megatron.qat.enable=true has no effect: the reward model only runs forward, and verl "
               "quantizes trained engines only")
    if config.actor_rollout_ref.actor.megatron.qat.enable:
        if rollout_weights_format() == "dequantized":
            yield ROLLOUT_NVFP4_NOT_BUILT
        qat = config.actor_rollout_ref.actor.megatron.qat
        if qat.activation_observer is not None and qat.mode == "w4a16":
            yield (f"{KEY}.activation_observer={qat.activation_observer} has no effect with mode=w4a16: an observer "
                   "of activations is W4A4's only (verl reads it there only; w4a16 leaves activations in full precision)")
        if config.actor_rollout_ref.actor.megatron.override_transformer_config.get("gradient_accumulation_fusion"):
            yield (f"{KEY}.enable=true: actor_rollout_ref.actor.megatron.override_transformer_config."
                   "gradient_accumulation_fusion=true is left out (megatron's fused weight-gradient accumulation "
                   "would bypass the fake-quantized weight's straight-through gradient); the actor accumulates "
                   "its weight gradients unfused")
