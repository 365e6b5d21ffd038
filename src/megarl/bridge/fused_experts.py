"""gpt-oss's fused expert tensors, seen per expert at the safetensors door.

HF gpt-oss (transformers 5.25 `GptOssExperts`, and the dequantized hub checkpoints) stores a
layer's experts as four tensors: `mlp.experts.gate_up_proj` [E, H, 2F] with gate and up
INTERLEAVED on the last axis (`_apply_gate`: gate = [..., ::2], up = [..., 1::2]),
`mlp.experts.gate_up_proj_bias` [E, 2F] (interleaved the same way), `mlp.experts.down_proj`
[E, F, H] and `mlp.experts.down_proj_bias` [E, H] (the forward is `x @ gate_up_proj[e] + bias`).
SGLang's `GptOssForCausalLM.load_weights` (sglang/srt/models/gpt_oss.py `_load_normal_weights`,
0.5.23) loads exactly these fused names.

The bridge maps one megatron parameter at a time, and megatron holds one `linear_fc1` /
`linear_fc2` per expert, so the HF reader presents each fused tensor as per-expert tensors
under the Qwen-MoE spelling plus biases (`mlp.experts.<e>.{gate,up,down}_proj.{weight,bias}`,
in `nn.Linear` orientation: gate/up [F, H], down [H, F]), and the HF writer fuses them back.
Both directions are exact selections and transposes, so a round trip is bit-exact.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from megarl.bridge.errors import ConversionError

FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$")
PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")

# fused tensor -> the per-expert (projection, kind) it holds
_PARTS = {
    "gate_up_proj": (("gate_proj", "weight"), ("up_proj", "weight")),
    "gate_up_proj_bias": (("gate_proj", "bias"), ("up_proj", "bias")),
    "down_proj": (("down_proj", "weight"),),
    "down_proj_bias": (("down_proj", "bias"),),
}
_FUSED_OF = {part: fused for fused, parts in _PARTS.items() for part in parts}


def is_fused(name: str) -> bool:
    return FUSED.match(name) is not None


def per_expert_names(fused_name: str, num_experts: int) -> list[str]:
    """The per-expert names a fused tensor stands for, expert-major."""
    head, kind = FUSED.match(fused_name).groups()
    return [f"{head}.{e}.{proj}.{w}" for e in range(num_experts) for proj, w in _PARTS[kind]]


def fused_source(name: str) -> tuple[str, int, str, str]:
    """(fused name, expert, projection, weight|bias) of a per-expert name."""
    head, e, proj, w = PER_EXPERT.match(name).groups()
    return f"{head}.{_FUSED_OF[(proj, w)]}", int(e), proj, w


def per_expert_shape(fused_shape: tuple[int, ...], proj: str, kind: str) -> tuple[int, ...]:
    """The shape of one expert's tensor cut from a fused tensor of `fused_shape` (expert axis first)."""
    if kind == "bias":
        return (fused_shape[1] // 2,) if proj != "down_proj" else (fused_shape[1],)
    rows, cols = fused_shape[1:]
    return (cols, rows) if proj == "down_proj" else (cols // 2, rows)


def fuses_experts(arch) -> bool:
    """Whether the model's HF checkpoints (and SGLang's loader) hold its experts fused: gpt-oss."""
    return arch.moe is not None and arch.moe.scheme == "gpt_oss"


def fused_shape(per_expert_name: str, shape: tuple[int, ...], num_experts: int) -> tuple[int, ...]:
    """The shape of the fused tensor holding the per-expert tensor `per_expert_name` of `shape`
    (the inverse of `per_expert_shape`): gate/up [F, H] -> [E, H, 2F], down [H, F] -> [E, F, H],
    gate/up bias [F] -> [E, 2F], down bias [H] -> [E, H]."""
    _, _, proj, _ = fused_source(per_expert_name)
    if proj == "down_proj":
        return (num_experts, *reversed(shape))
    return (num_experts, shape[1], 2 * shape[0]) if len(shape) == 2 else (num_experts, 2 * shape[0])


def expert_view(expert_slice: torch.Tensor, proj: str) -> torch.Tensor:
    """One expert's slice of a fused tensor ([H, 2F], [2F], [F, H] or [H]) seen as its per-expert
    tensor ([F, H], [F], [H, F] or [H]): a strided view, so writing into it writes the fused tensor."""
    if proj == "down_proj":
        return expert_slice.t() if expert_slice.dim() == 2 else expert_slice
    half = expert_slice[..., 0::2] if proj == "gate_proj" else expert_slice[..., 1::2]
    return half.t() if half.dim() == 2 else half


def cut(expert_slice: torch.Tensor, proj: str) -> torch.Tensor:
    """One expert's slice of a fused tensor ([H, 2F], [2F], [F, H] or [H]) -> its per-expert tensor."""
    return expert_view(expert_slice, proj).contiguous()


def fuse(kind: str, per_expert: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """Per expert (in expert order) the parts of `_PARTS[kind]` -> the fused tensor."""
    out = []
    for parts in per_expert:
        if kind in ("down_proj", "down_proj_bias"):
            (t,) = parts
            out.append(t.t() if kind == "down_proj" else t)
        else:
            gate, up = (p.t() if kind == "gate_up_proj" else p for p in parts)
            out.append(torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1]))
    return torch.stack(out).contiguous()


class ExpertFuser:
    """Collects per-expert tensors (as `fused_source` names them) and hands back each fused
    tensor once all `num_experts` experts' parts of it have arrived; other tensors pass through."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if not PER_EXPERT.match(name):
            return [(name, tensor)]
        fused, e, proj, _ = fused_source(name)
        pending = self._pending.setdefault(fused, {})
        pending[(e, proj)] = tensor
        parts = _PARTS[FUSED.match(fused).group(2)]
        if len(pending) < self.num_experts * len(parts):
            return []
        del self._pending[fused]
        kind = FUSED.match(fused).group(2)
        return [(fused, fuse(kind, [tuple(pending[(e, p)] for p, _ in parts) for e in range(self.num_experts)]))]

    def close(self) -> None:
        if self._pending:
            raise ConversionError(f"fused expert tensors left incomplete: {sorted(self._pending)}")


def read_cut(read_slice: Callable[[str], object], name: str) -> torch.Tensor:
    """The per-expert tensor `name`, read from its fused tensor's slice (`read_slice(fused)` is
    a safetensors slice: only the expert's bytes are read)."""
    fused, e, proj, _ = fused_source(name)
    return cut(read_slice(fused)[e], proj)
