"""Quantization-aware training of the actor: NVFP4 W4A16 fake quantization of its Megatron linears
(verl's `actor_rollout_ref.actor.megatron.qat`, verl/utils/modelopt/quantize.py `apply_qat`).

verl quantizes with NVIDIA ModelOpt (`mtq.quantize`): every megatron ColumnParallelLinear /
RowParallelLinear (and their transformer-engine forms; modelopt torch/quantization/plugins/megatron.py)
gets a `weight_quantizer`, disabled where its name, `<module name>.weight_quantizer`, matches (fnmatch)
one of ModelOpt's default exclusions (modelopt_recipes/configs/ptq/units/default_disabled_quantizers.yaml:
the output layer, MoE routers, the MTP block, ...) or one of `ignore_patterns`, HF-style names mapped
to megatron's first (verl's `_ignore_patterns_to_quant_cfg`: "lm_head" -> "*output_layer*",
"*mlp.gate" -> "*router*", "*self_attn*" -> "*self_attention*"). megarl matches the same names, the
module's name in the GPTModel (e.g. `decoder.layers.0.mlp.linear_fc1.weight_quantizer`): in megarl's
models verl's defaults leave out `output_layer` (and a router is no linear: never quantized); every
linear_qkv, linear_proj, linear_fc1, linear_fc2 (experts' and shared experts' too) is quantized.

A quantized linear computes with `nvfp4_fake_quant(weight)` in each forward (recomputed ones too);
the parameter stays the full-precision master weight, which the optimizer updates with the
straight-through gradient. Each such parameter is marked (`PARAM_MARK`) so that the weight
push sends the same dequantized values (`megarl.sync.resharder`, `fake_quant`).
"""
from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from megarl.algos.nvfp4 import PARAM_MARK, nvfp4_fake_quant

# ModelOpt 0.47.0's default exclusions by name (default_disabled_quantizers.yaml; its parent_class
# entries name BatchNorm, LeakyReLU and Embedding modules, never a linear)
MODELOPT_DISABLED = ("*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*self_attention.conv1d*",
                     "*linear_attn.in_proj_a*", "*linear_attn.in_proj_b*", "*lm_head*", "*mixer.conv1d*",
                     "*mlp.gate.*", "*mlp.shared_expert_gate.*", "*output_layer*", "*proj_out.*", "*router*",
                     "mtp.*", "output.*", "*embed_vision*", "*vision_tower*", "*visual*", "*vision_model*",
                     "*multi_modal_projector*")
# verl's HF -> megatron names of its patterns (verl/utils/modelopt/quantize.py `_ignore_patterns_to_quant_cfg`)
VERL_PATTERN_NAMES = {"lm_head": "*output_layer*", "*mlp.gate": "*router*", "*self_attn*": "*self_attention*"}


@dataclass(frozen=True)
class QatSpec:
    """The actor's QAT: NVFP4 weights (W4A16) in groups of `group_size`, but for the linears whose
    names match `ignore_patterns` (verl's spelling)."""

    group_size: int = 16
    ignore_patterns: tuple[str, ...] = ("lm_head", "*mlp.gate")


def transformer_overrides(overrides: dict) -> dict:
    """A QAT actor's TransformerConfig overrides: without `gradient_accumulation_fusion` (verl-recipe's QAT
    scripts turn it on). Megatron's fused weight-gradient path (tensor_parallel/layers.py
    `LinearWithGradAccumulationAndAsyncCommunication.backward`) accumulates into `weight.main_grad` of
    the tensor the layer multiplied, here the fake-quantized copy, and marks that copy
    `grad_added_to_main_grad`, so the master's gradient would be lost or doubled: the unfused path's
    gradient reaches the master through the straight-through estimator (config.rules.qat warns)."""
    return {k: v for k, v in overrides.items() if k != "gradient_accumulation_fusion"}


def is_quantized(module_name: str, ignore_patterns: Sequence[str]) -> bool:
    """Whether ModelOpt, configured as verl configures it, enables the weight quantizer of the linear
    `module_name` (its name in the GPTModel)."""
    quantizer = f"{module_name}.weight_quantizer"
    patterns = list(MODELOPT_DISABLED) + [VERL_PATTERN_NAMES.get(p, p) for p in ignore_patterns]
    return not any(fnmatch.fnmatch(quantizer, pattern) for pattern in patterns)


def _quantized_forward(module: torch.nn.Module, forward, group_size: int, *args, **kwargs):
    """`forward` with the module's weight replaced by its fake-quantized values for this call."""
    master = module._parameters["weight"]
    module._parameters["weight"] = nvfp4_fake_quant(master, group_size)
    try:
        return forward(*args, **kwargs)
    finally:
        module._parameters["weight"] = master


def attach_qat(chunks: Sequence[torch.nn.Module], spec: QatSpec) -> list[str]:
    """Fake-quantize the weights of the chunks' megatron linears that ModelOpt would (see the module
    docstring); returns their module names. Call on the unwrapped GPTModel chunks before DDP."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    names = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            if module.weight is None or not is_quantized(name, spec.ignore_patterns):
                continue
            if module.weight.shape[-1] % spec.group_size:
                raise ValueError(f"actor_rollout_ref.actor.megatron.qat: {name}'s weight {list(module.weight.shape)} "
                                 f"has no whole NVFP4 groups of {spec.group_size} along its input dimension; "
                                 "leave it out with qat.ignore_patterns")
            setattr(module.weight, PARAM_MARK, spec.group_size)
            module.forward = functools.partial(_quantized_forward, module, module.forward, spec.group_size)
            names.append(name)
    return names
