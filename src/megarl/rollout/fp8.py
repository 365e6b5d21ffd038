"""Block FP8 weights, the format the rollout servers serve with `actor_rollout_ref.rollout.quantization=fp8`
(DeepSeek-V3's, which SGLang 0.5.23 and transformers load). Pure torch, on any device; both ends use it:
the trainer quantizes every push and writes the servers' initial checkpoint (`megarl.sync.fp8_checkpoint`),
the CPU engine dequantizes what it loads.

The format. A quantized linear weight W [out, in] is stored as `<name>.weight`, float8_e4m3fn [out, in],
and `<name>.weight_scale_inv`, float32 [ceil(out / 128), ceil(in / 128)]: block (i, j) covers rows
[128 i, 128 i + 128) and columns [128 j, 128 j + 128), cut short at the tensor's edge (a ragged last
block), and W ~ weight * weight_scale_inv[i, j] inside it. config.json says so with
`quantization_config` = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}, plus `ignored_layers` for linear layers kept unquantized (verl 0.9.1
`utils/sglang/sglang_fp8_utils.py::build_sglang_fp8_quant_config` writes the same dict; SGLang 0.5.23
reads it in `layers/quantization/fp8.py::Fp8Config.from_config`, `ignored_layers` or
`modules_to_not_convert`).

Quantizing (`quantize`) is transformers 5.25's `integrations/finegrained_fp8.py::Fp8Quantize._quantize_one`
(the same as verl 0.9.1's `utils/kernel/fp8_kernel.py::_scaled_fp8_blockwise_pytorch`): per block, in
float32, amax = max |W|, scale = 448 / amax (1 for an all-zero block), weight = clamp(W * scale, -448, 448)
cast to e4m3 (round to nearest even), weight_scale_inv = 1 / scale. A ragged block is quantized as if
padded with zeros, which leaves its amax alone (verl pads; transformers quantizes only whole blocks).
Dequantizing (`dequantize`) is SGLang 0.5.23's `layers/quantization/fp8_utils.py::block_quant_dequant`:
float32(weight) * weight_scale_inv of its block, cast to the compute dtype.

Which weights are quantized follows SGLang 0.5.23: `Fp8Config.get_quant_method` quantizes every linear
layer (`LinearBase`) and fused MoE experts (`FusedMoE`) unless `ignored_layers` names it, and nothing
else: the embeddings and the LM head (`VocabParallelEmbedding`, `ParallelLMHead`) stay unquantized, as do
norms, biases, and the MoE routers and Qwen2-MoE's shared-expert gate, which the models build without a
quantization config (`models/qwen2_moe.py`, `qwen3_moe.py`, `mixtral.py`). SGLang also refuses at start a
quantized layer whose blocks would straddle its TP shards or the parts of a fused layer
(`Fp8LinearMethod.validate_block_quant_shapes`, `Fp8MoEMethod.create_weights`); megarl keeps such layers
unquantized and lists them in `ignored_layers` (`plan`), all shards of a fused layer together (SGLang
refuses a fused layer quantized in part: `layers/quantization/utils.py::is_layer_skipped`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
BLOCK = 128  # rows and columns of a block
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` -> `<name>.weight_scale_inv`


def quantization_config(ignored_layers: Iterable[str] = ()) -> dict:
    """config.json's `quantization_config` of a megarl FP8 checkpoint: verl's dict, and the layers kept
    unquantized, if any, under SGLang's name (`ignored_layers`) and transformers' (`modules_to_not_convert`,
    `FineGrainedFP8Config`)."""
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    ignored = list(ignored_layers)
    if ignored:
        config["ignored_layers"] = config["modules_to_not_convert"] = ignored
    return config


@dataclass(frozen=True)
class Fp8Serving:
    """A checkpoint's block-FP8 settings, as a server takes them (`parse_quantization_config`)."""

    ignored_layers: tuple[str, ...] = ()


def parse_quantization_config(config: Optional[Mapping]) -> Optional[Fp8Serving]:
    """config.json's `quantization_config` -> its FP8 settings, or None for an unquantized checkpoint.
    Raises ValueError for what SGLang 0.5.23's `Fp8Config.__init__` / `from_config` refuse (an unknown
    activation scheme; a block size of other than 2 dimensions; blocks without the dynamic scheme), and
    for what megarl does not serve: another method or format than fp8 e4m3, another block than 128 x 128."""
    if not config:
        return None
    method = config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r}: megarl serves fp8 only")
    scheme = config.get("activation_scheme")
    if scheme not in ("static", "dynamic"):  # SGLang's ACTIVATION_SCHEMES
        raise ValueError(f"Unsupported activation scheme {scheme}")
    block = config.get("weight_block_size")
    if block is not None and len(block) != 2:
        raise ValueError("The quantization block size of weight must have 2 dimensions, but got "
                         f"{len(block)} dimensions.")
    if block is not None and scheme != "dynamic":
        raise ValueError("The block-wise quantization only supports dynamic activation scheme for now, but got "
                         f"{scheme} activation scheme.")
    if list(block or []) != [BLOCK, BLOCK] or config.get("fmt", "e4m3") != "e4m3" or config.get("scale_fmt"):
        raise ValueError(f"quantization_config {dict(config)}: megarl serves block FP8 of e4m3 values, "
                         f"{BLOCK} x {BLOCK} blocks and float32 scales only")
    ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
    return Fp8Serving(tuple(ignored))


# ------------------------------------------------------------------------------------------ the numbers
def scale_name(weight_name: str) -> str:
    """`model.layers.0.mlp.down_proj.weight` -> `model.layers.0.mlp.down_proj.weight_scale_inv`."""
    return weight_name + SCALE_SUFFIX


def scale_shape(shape: Iterable[int]) -> tuple[int, int]:
    """The blocks of a [out, in] weight: (ceil(out / 128), ceil(in / 128))."""
    rows, cols = shape
    return -(-rows // BLOCK), -(-cols // BLOCK)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (values float8_e4m3fn [out, in], weight_scale_inv float32 `scale_shape`), on
    `weight`'s device, by transformers' formula (module docstring)."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    blocks_r, blocks_c = scale_shape(weight.shape)
    padded = F.pad(weight.float(), (0, blocks_c * BLOCK - cols, 0, blocks_r * BLOCK - rows))
    tiles = padded.view(blocks_r, BLOCK, blocks_c, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))  # [blocks_r, blocks_c]
    nonzero = amax > 0
    scale = torch.where(nonzero, FP8_MAX / torch.where(nonzero, amax, torch.ones_like(amax)), torch.ones_like(amax))
    values = torch.clamp(tiles * scale[:, None, :, None], min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)
    return values.view(blocks_r * BLOCK, blocks_c * BLOCK)[:rows, :cols].contiguous(), (1.0 / scale).float()


def dequantize(values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [out, in], weight_scale_inv) -> the weight in `dtype`, by SGLang's `block_quant_dequant`:
    float32(values) * weight_scale_inv of each element's block, then cast."""
    rows, cols = values.shape
    if tuple(scale_inv.shape) != scale_shape(values.shape):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight of shape {(rows, cols)}: "
                         f"{BLOCK} x {BLOCK} blocks need {scale_shape(values.shape)}")
    per_element = scale_inv.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return (values.float() * per_element).to(dtype)


# ------------------------------------------------------------------------------------------ which weights
# The linear weights SGLang builds with the FP8 method, by their HF names: attention's q/k/v (fused in
# SGLang as qkv_proj) and o_proj, the MLP's gate/up (fused as gate_up_proj) and down_proj (also Qwen2-MoE's
# shared expert), and the routed experts (one FusedMoE per layer). Routers (`mlp.gate`,
# `block_sparse_moe.gate`, `shared_expert_gate`), embeddings, the LM head and norms do not match.
_QKV = re.compile(r"^(?P<module>.+\.self_attn)\.(?P<part>[qkv])_proj\.weight$")
_O = re.compile(r"^.+\.self_attn\.o_proj\.weight$")
_GATE_UP = re.compile(r"^(?P<module>.+\.(?:mlp|mlp\.shared_expert))\.(?P<part>gate|up)_proj\.weight$")
_DOWN = re.compile(r"^.+\.(?:mlp|mlp\.shared_expert)\.down_proj\.weight$")
_EXPERT = re.compile(r"^(?P<module>.+\.(?:mlp|block_sparse_moe)\.experts)\.\d+\."
                     r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")


def sglang_layer(name: str) -> Optional[tuple[str, str]]:
    """(SGLang's layer, kind) of a quantizable HF weight, or None for a weight SGLang never quantizes.
    The layer is what `ignored_layers` names: the weight's own module for q/k/v, gate/up (SGLang
    checks each shard of a fused layer), o and down; the layer's `experts` module for an expert.
    Kind: "qkv", "gate_up" (column parallel, fused), "row" (o_proj, down_proj), "experts_in"
    (gate/up, w1/w3), "experts_out" (down, w2)."""
    if m := _QKV.match(name):
        return name.removesuffix(".weight"), "qkv"
    if m := _GATE_UP.match(name):
        return name.removesuffix(".weight"), "gate_up"
    if _O.match(name) or _DOWN.match(name):
        return name.removesuffix(".weight"), "row"
    if m := _EXPERT.match(name):
        return m["module"], "experts_out" if m["part"] in ("down_proj", "w2") else "experts_in"
    return None


def _fused_module(name: str) -> str:
    """The fused SGLang layer a weight belongs to (qkv_proj, gate_up_proj, the experts), else its own module."""
    if m := _QKV.match(name):
        return f"{m['module']}.qkv_proj"
    if m := _GATE_UP.match(name):
        return f"{m['module']}.gate_up_proj"
    layer = sglang_layer(name)
    return layer[0] if layer else name


def _matches(ignored: str, prefix: str) -> bool:
    """SGLang 0.5.23 `layers/quantization/utils.py::_module_path_match`: on dotted module boundaries."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


def is_ignored(layer: str, ignored_layers: Iterable[str]) -> bool:
    """Whether `ignored_layers` (config.json's) keeps SGLang's `layer` unquantized; `Fp8Config.from_config`
    adds each entry with and without the `model.` prefix."""
    bases = [entry.removeprefix("model.") for entry in ignored_layers]
    entries = bases + ["model." + base for base in bases]
    return any(_matches(entry, layer) for entry in entries)


def quantized_weights(names: Iterable[str], ignored_layers: Iterable[str]) -> frozenset[str]:
    """The HF weights of `names` a server stores in FP8 under `ignored_layers` (config.json's). Raises
    ValueError, as SGLang's `is_layer_skipped` does, for a fused layer quantized in part."""
    ignored_layers = list(ignored_layers)
    quantized, fused_state = set(), {}
    for name in names:
        layer = sglang_layer(name)
        if layer is None:
            continue
        skipped = is_ignored(layer[0], ignored_layers)
        fused = _fused_module(name)
        if fused_state.setdefault(fused, skipped) != skipped:
            raise ValueError(f"Detected some but not all shards of {fused} are quantized. All shards of fused layers "
                             "to have the same precision.")
        if not skipped:
            quantized.add(name)
    return frozenset(quantized)


def block_shape_problem(name: str, shape: tuple[int, ...], tp_size: int, ep_size: int = 1,
                        kv_heads: Optional[int] = None) -> Optional[str]:
    """Why SGLang 0.5.23, serving at TP `tp_size` (EP `ep_size` over those ranks), refuses to quantize
    quantizable weight `name` of HF shape [out, in] in 128 x 128 blocks, or None. Its rules
    (`Fp8LinearMethod.validate_block_quant_shapes`, `Fp8MoEMethod.create_weights`): a fused layer's
    parts (q, k, v; gate, up) have per-rank rows that are multiples of 128; at TP > 1 a column-parallel
    layer's per-rank rows, and a row-parallel one's per-rank columns, too; an expert's per-rank
    intermediate size (over TP / EP ranks) is a multiple of 128. `kv_heads`: the model's key/value
    heads, which SGLang replicates when there are fewer than TP ranks (None: no replication)."""
    rows, cols = shape
    kind = sglang_layer(name)[1]
    if kind == "qkv":
        per_rank = rows // tp_size
        if kv_heads is not None and name.endswith(("k_proj.weight", "v_proj.weight")) and kv_heads < tp_size:
            per_rank = rows // kv_heads
        if per_rank % BLOCK:
            return f"{name}: {per_rank} rows per TP rank of the fused qkv_proj, not a multiple of {BLOCK}"
    elif kind == "gate_up":
        if (rows // tp_size) % BLOCK:
            return f"{name}: {rows // tp_size} rows per TP rank of the fused gate_up_proj, not a multiple of {BLOCK}"
    elif kind == "row":
        if tp_size > 1 and (cols // tp_size) % BLOCK:
            return f"{name}: {cols // tp_size} input columns per TP rank, not a multiple of {BLOCK}"
    else:  # experts: gate/up's rows always, down's columns at an expert TP above 1
        moe_tp = max(1, tp_size // ep_size)
        per_rank = (rows if kind == "experts_in" else cols) // moe_tp
        if per_rank % BLOCK and (kind == "experts_in" or moe_tp > 1):
            return f"{name}: expert intermediate size {per_rank} per rank, not a multiple of {BLOCK}"
    return None


@dataclass(frozen=True)
class Fp8Plan:
    """What a megarl FP8 checkpoint and every push quantize: `quantized` HF weight names, and the
    SGLang layers kept unquantized (`ignored_layers`, with the reason of each in `problems`)."""

    quantized: frozenset[str]
    ignored_layers: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


def plan(shapes: Mapping[str, tuple[int, ...]], tp_size: int = 1, ep_size: int = 1,
         kv_heads: Optional[int] = None) -> Fp8Plan:
    """The FP8 plan of a model of HF tensors `shapes` ({name: shape}) served at TP `tp_size`, EP
    `ep_size`: every quantizable weight in 128 x 128 blocks but those of the layers SGLang would refuse
    (`block_shape_problem`), which stay unquantized with every other shard of their fused layer."""
    problems, refused = [], set()
    for name, shape in shapes.items():
        if sglang_layer(name) is None:
            continue
        problem = block_shape_problem(name, tuple(shape), tp_size, ep_size, kv_heads)
        if problem:
            problems.append(problem)
            refused.add(_fused_module(name))
    ignored = sorted({sglang_layer(n)[0] for n in shapes if sglang_layer(n) and _fused_module(n) in refused})
    quantized = quantized_weights(shapes, ignored)
    return Fp8Plan(quantized, tuple(ignored), tuple(problems))


def held_as_sent(name: str, dtype: torch.dtype) -> bool:
    """Whether a server holds pushed tensor `name` of `dtype` as sent, not cast to its compute dtype:
    FP8 values and their scales (SGLang's `weight` and `weight_scale_inv` parameters)."""
    return dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX)
