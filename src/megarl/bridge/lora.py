"""LoRA adapters: their megatron names, TP splits, PEFT names, and merging them into HF weights.

An adapter of PEFT target t (q_proj ... down_proj) on layer i is two parameters of a module
attached beside megatron's linear layer (megarl.engines.megatron.lora):
  decoder.layers.{i}.self_attention.linear_qkv_lora.{q,k,v}_proj_{A,B}
  decoder.layers.{i}.self_attention.linear_proj_lora.o_proj_{A,B}
  decoder.layers.{i}.mlp.linear_fc1_lora.{gate,up}_proj_{A,B}
  decoder.layers.{i}.mlp.linear_fc2_lora.down_proj_{A,B}
Full shapes are PEFT's: A [r, in], B [out, r], with `in`/`out` those of the HF projection; the
adapter adds (alpha / r) x B A x to the projection's output.

TP (the math of a column- or row-parallel base, async-lora-moe.md §2): on a column-parallel base
(linear_qkv, linear_fc1) each rank computes its own output rows, so B is split along dim 0 and A is
whole on every rank; on a row-parallel base (linear_proj, linear_fc2) each rank holds a slice of
the input, so A is split along dim 1 and B is whole. B's rows split contiguously: megatron's TP
ranks hold consecutive query groups (q, k, v rows of HF order) and consecutive halves of gate and up.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.bridge.errors import ConversionError
from megarl.bridge.mapping import COLUMN, REPLICATED, ROW, TPSplit
from megarl.bridge.output_dir import atomic_output_dir
from megarl.bridge.safetensors_io import save_safetensors

SUFFIX = "_lora"
# PEFT target -> (megatron sub-module path in a layer, column-parallel base)
TARGETS: dict[str, tuple[str, bool]] = {
    "q_proj": ("self_attention.linear_qkv", True),
    "k_proj": ("self_attention.linear_qkv", True),
    "v_proj": ("self_attention.linear_qkv", True),
    "o_proj": ("self_attention.linear_proj", False),
    "gate_proj": ("mlp.linear_fc1", True),
    "up_proj": ("mlp.linear_fc1", True),
    "down_proj": ("mlp.linear_fc2", False),
}
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_PREFIX = "base_model.model.model.layers"
# a live (local or global) name, or a torch_dist key (layers stacked: no index)
_NAME = re.compile(r"(?:.*\.)?decoder\.layers\.(?:(\d+)\.)?(self_attention|mlp)\.(linear_\w+)" + SUFFIX
                   + r"\.(\w+)_([AB])$")


@dataclass(frozen=True)
class AdapterName:
    layer: int  # global layer index
    target: str  # PEFT target, e.g. "q_proj"
    factor: str  # "A" or "B"

    @property
    def mcore(self) -> str:
        return f"decoder.layers.{self.layer}.{TARGETS[self.target][0]}{SUFFIX}.{self.target}_{self.factor}"

    @property
    def peft(self) -> str:
        return f"{PEFT_PREFIX}.{self.layer}.{HF_MODULE[self.target]}.{self.target}.lora_{self.factor}.weight"

    @property
    def hf_base(self) -> str:
        """The HF weight this adapter adds to."""
        return f"model.layers.{self.layer}.{HF_MODULE[self.target]}.{self.target}.weight"

    @property
    def tp(self) -> TPSplit:
        column = TARGETS[self.target][1]
        if self.factor == "A":
            return REPLICATED if column else ROW
        return COLUMN if column else REPLICATED


def is_lora_param(name: str) -> bool:
    """Whether a (local or global) megatron parameter name is an adapter's."""
    return _NAME.match(name) is not None


def parse(name: str) -> AdapterName:
    """The adapter of a megatron parameter name (local names give the local layer index)."""
    m = _NAME.match(name)
    if m is None or m.group(1) is None or m.group(4) not in TARGETS:
        raise ValueError(f"{name!r} is not a LoRA adapter parameter")
    return AdapterName(int(m.group(1)), m.group(4), m.group(5))


def peft_config(targets, rank: int, alpha: float, base_model: str) -> dict:
    """PEFT's `adapter_config.json` for adapters of `targets` (PEFT names)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": base_model, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "modules_to_save": None,
    }


def merge_into_hf(hf: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float) -> None:
    """Add scale x B A (computed in float32) to every adapted HF weight present in `hf`, in
    place. `adapters`: full tensors by megatron adapter name."""
    for name, a in adapters.items():
        adapter = parse(name)
        if adapter.factor != "A" or adapter.hf_base not in hf:
            continue
        b = adapters[AdapterName(adapter.layer, adapter.target, "B").mcore]
        base = hf[adapter.hf_base]
        hf[adapter.hf_base] = (base.float() + scale * (b.float() @ a.float())).to(base.dtype)


# any adapter factor, on whatever module: `<module>_lora.<target>_<A|B>`
_ANY_ADAPTER = re.compile(re.escape(SUFFIX) + r"\.\w+_[AB]$")


def unmergeable_adapters(keys) -> list[str]:
    """The checkpoint keys of adapter factors on modules other than `TARGETS`' (an MoE model's
    experts, router or shared expert: megarl's LoRA adapts only attention there, lora.refuse_expert_targets),
    which megarl can neither merge nor write as a PEFT adapter. Optimizer states are not counted."""
    return sorted(k for k in keys if _ANY_ADAPTER.search(k) and not is_lora_param(k) and not k.startswith("optimizer."))


def read_adapters(reader) -> dict[str, torch.Tensor]:
    """{global adapter name: full tensor} of a `torch_dist` checkpoint (a `TorchDistReader`); its
    layer-stacked keys ([L, ...]) are split per layer. Empty when it holds no adapters. Adapters on
    modules megarl does not map (`unmergeable_adapters`) are refused by name."""
    unmergeable = unmergeable_adapters(reader.tensors)
    if unmergeable:
        raise ConversionError(
            f"{reader.dir}: holds LoRA adapters on modules megarl cannot merge or export, e.g. {unmergeable[:3]} "
            "(megarl's LoRA adapts the attention projections only; on an MoE model not its experts, router or "
            "shared expert)"
        )
    out = {}
    for key, entry in reader.tensors.items():
        m = _NAME.match(key)
        if m is None or key.startswith("optimizer."):
            continue
        if m.group(1) is not None:
            out[key] = reader.read(key)
            continue
        stacked = reader.read(key)
        for layer in range(entry.global_shape[0]):
            out[key.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)] = stacked[layer].clone()
    return out


def peft_adapter(adapters: dict[str, torch.Tensor], rank: int, alpha: float, base_model: str) -> tuple[dict, dict]:
    """(adapter_config.json as a dict, {PEFT tensor name: float32 contiguous CPU tensor}) of
    `adapters` (global megatron names, full tensors): what `write_peft_adapter` writes to disk
    and adapter-only sync sends (`sync.adapter_sync`)."""
    if not adapters:
        raise ValueError("no LoRA adapters")
    names = [parse(n) for n in adapters]
    wrong = [n.mcore for n in names if adapters[n.mcore].shape[0 if n.factor == "A" else 1] != rank]
    if wrong:
        raise ValueError(f"adapters {wrong[:3]} do not have rank {rank}")
    # a copy of each: a parameter may be a view into a larger buffer, which pickling would send whole
    tensors = {n.peft: adapters[n.mcore].detach().to("cpu", torch.float32).clone(memory_format=torch.contiguous_format)
               for n in names}
    return peft_config({n.target for n in names}, rank, alpha, base_model), tensors


def write_peft_adapter(adapters: dict[str, torch.Tensor], out_dir, rank: int, alpha: float, base_model: str):
    """Write `adapters` (global megatron names, full tensors) as a PEFT LoRA adapter in `out_dir`:
    `adapter_config.json` and `adapter_model.safetensors` (`peft_adapter`'s float32 contiguous tensors)."""
    config, tensors = peft_adapter(adapters, rank, alpha, base_model)
    with atomic_output_dir(out_dir) as tmp:
        save_safetensors(tensors, Path(tmp) / "adapter_model.safetensors")
        (Path(tmp) / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)
