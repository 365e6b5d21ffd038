"""The CPU engine's block-FP8 weights (`megarl.rollout.fp8`): it serves an FP8 checkpoint as SGLang
0.5.23 does on GPUs, holding each quantized linear weight as its e4m3 values and `weight_scale_inv`
(SGLang's `weight` and `weight_scale_inv` parameters: what its `/weights_checker` hashes), and computes
with their per-block dequantization in its compute dtype (the transformers model's parameter).

What it refuses, as SGLang does (`layers/quantization/fp8.py`, `model_loader/loader.py`): a float32
compute dtype (`_get_quantization_config`: "torch.float32 is not supported for quantization method fp8");
a quantization config SGLang's `Fp8Config` refuses (`fp8.parse_quantization_config`); a quantized layer
whose blocks straddle the parts of a fused layer (`Fp8LinearMethod.validate_block_quant_shapes`, at this
engine's TP size 1: `fp8.block_shape_problem`); a fused layer quantized in part (`is_layer_skipped`).
And, stricter than SGLang, which would load such tensors with a silent cast or keep the old scales: a
quantized weight that is not e4m3, or comes without its `weight_scale_inv` (in a checkpoint, or in the
same weight-update request), a scale of the wrong shape, FP8 values or a scale for a layer that is not
quantized.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from megarl.rollout import fp8
from megarl.rollout.cpu.checkpoint_names import checkpoint_named_tensors, checkpoint_tensor
from megarl.rollout.protocol import BadRequestError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SGLANG_FP8_DTYPES = (torch.bfloat16, torch.float16)  # SGLang 0.5.23 Fp8Config.get_supported_act_dtypes


def checkpoint_quantization(model_path: str) -> Optional[fp8.Fp8Serving]:
    """The FP8 settings in `model_path`'s config.json (None: not quantized). Raises ValueError for a
    config SGLang refuses."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return fp8.parse_quantization_config(config.get("quantization_config"))


def read_checkpoint(model_path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors checkpoint at `model_path` (`model.safetensors` or the shards
    its index lists)."""
    path = Path(model_path)
    index = path / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [SINGLE_FILE]
    tensors = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})  # noqa: SIM118
    return tensors


class Fp8Weights:
    """The quantized weights of a served model: `held[name]` = (e4m3 values, float32 weight_scale_inv)
    of each quantized HF weight name; the model's parameter of that name holds their dequantization."""

    def __init__(self, held: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        self.held = held

    @property
    def quantized(self) -> frozenset[str]:
        return frozenset(self.held)

    def split(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
              state: dict[str, torch.Tensor]) -> tuple[list, dict]:
        """A weight update's tensors -> (the unquantized (name, tensor) pairs, {quantized weight name:
        (values, weight_scale_inv)}). Raises BadRequestError for FP8 tensors that do not fit the model
        (`state`: its state_dict) and what is served (module docstring); every quantized weight must
        come with its scale, and the reverse."""
        plain, values, scales = [], {}, {}
        for name, tensor in named_tensors:
            weight = name.removesuffix(fp8.SCALE_SUFFIX)
            if weight != name:
                if weight not in self.held:
                    raise BadRequestError(f"{name}: a weight_scale_inv for {weight}, which is not quantized here")
                scales[weight] = tensor
            elif name in self.held:
                if tensor.dtype != fp8.FP8_DTYPE:
                    raise BadRequestError(f"{name} is {tensor.dtype}; this server holds it in block FP8 "
                                          f"({fp8.FP8_DTYPE} values with their weight_scale_inv)")
                values[name] = tensor
            elif tensor.dtype == fp8.FP8_DTYPE:
                raise BadRequestError(f"{name} is {fp8.FP8_DTYPE}, but this server does not quantize it")
            else:
                plain.append((name, tensor))
        unpaired = sorted(set(values) ^ set(scales))
        if unpaired:
            raise BadRequestError(f"block FP8 weights and their weight_scale_inv must come together in one request; "
                                  f"{unpaired[0]} comes without its {'scale' if unpaired[0] in values else 'values'}"
                                  f"{f' ({len(unpaired)} such)' if len(unpaired) > 1 else ''}")
        for name, q in values.items():
            expected = tuple(checkpoint_tensor(state, name).shape)
            if tuple(q.shape) != expected:
                raise BadRequestError(f"weight {name!r} has shape {tuple(q.shape)}, the model expects {expected}")
            if tuple(scales[name].shape) != fp8.scale_shape(q.shape):
                raise BadRequestError(f"{fp8.scale_name(name)} has shape {tuple(scales[name].shape)}; a weight of "
                                      f"shape {tuple(q.shape)} has {fp8.scale_shape(q.shape)} blocks of "
                                      f"{fp8.BLOCK} x {fp8.BLOCK}")
        return plain, {name: (q, scales[name]) for name, q in values.items()}

    def apply(self, updates: dict[str, tuple[torch.Tensor, torch.Tensor]], state: dict[str, torch.Tensor]) -> None:
        """Hold each update's values and scales (copies, as SGLang copies into its parameters) and write their
        dequantization into the model's tensor of that name (`state`: its state_dict)."""
        for name, (q, scale_inv) in updates.items():
            held = (q.clone(), scale_inv.to(torch.float32, copy=True))
            target = checkpoint_tensor(state, name)
            target.copy_(fp8.dequantize(*held, target.dtype))
            self.held[name] = held

    def checked_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The model's tensors (checkpoint names) as SGLang holds them: each quantized weight as its
        values, followed by its `weight_scale_inv`."""
        out = []
        for name, tensor in named:
            if name in self.held:
                q, scale_inv = self.held[name]
                out += [(name, q), (fp8.scale_name(name), scale_inv)]
            else:
                out.append((name, tensor))
        return out


def load_fp8_causal_lm(model_path: str, serving: fp8.Fp8Serving,
                       dtype: torch.dtype) -> tuple[torch.nn.Module, Fp8Weights]:
    """A block-FP8 checkpoint as a transformers model computing in `dtype` (eval mode, no grads), every
    quantized weight dequantized per block, and its held FP8 weights. Raises ValueError for what
    SGLang refuses and for a checkpoint that leaves a parameter of the model unset (module docstring)."""
    if dtype not in SGLANG_FP8_DTYPES:
        raise ValueError(f"{dtype} is not supported for quantization method fp8. Supported dtypes: "
                         f"{list(SGLANG_FP8_DTYPES)}")
    config = AutoConfig.from_pretrained(model_path)
    del config.quantization_config  # the model computes in `dtype`; the FP8 weights are this module's
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    tensors = read_checkpoint(model_path)
    quantized = fp8.quantized_weights(tensors, serving.ignored_layers)
    for name in sorted(quantized):
        problem = fp8.block_shape_problem(name, tuple(tensors[name].shape), tp_size=1)
        if problem:
            raise ValueError(f"{model_path}: SGLang refuses to quantize this layer in {fp8.BLOCK} x {fp8.BLOCK} "
                             f"blocks: {problem}")
    weights = Fp8Weights(dict.fromkeys(quantized))  # filled by `apply`
    state = model.state_dict()
    missing = [name for name in sorted(quantized) if checkpoint_tensor(state, name) is None]
    if missing:
        raise ValueError(f"{model_path}: tensor {missing[0]} does not fit the model")
    try:
        plain, updates = weights.split(tensors.items(), state)
    except BadRequestError as e:
        raise ValueError(f"{model_path}: {e}") from None
    loaded = set()
    with torch.no_grad():
        for name, tensor in plain:
            target = checkpoint_tensor(state, name)
            if target is None or tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{model_path}: tensor {name} of shape {tuple(tensor.shape)} does not fit the model")
            target.copy_(tensor)
            loaded.add(name)
        weights.apply(updates, state)
    unset = [n for n, _ in checkpoint_named_tensors(model.named_parameters(),
                                                    mixtral=getattr(config, "model_type", "") == "mixtral")
             if n not in loaded and n not in quantized]
    if unset:
        raise ValueError(f"{model_path}: the checkpoint does not set {len(unset)} parameters of the model, "
                         f"e.g. {unset[0]}")
    return model, weights
