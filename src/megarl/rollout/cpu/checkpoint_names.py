"""Checkpoint names of a transformers model's tensors, for the CPU engine's weight updates and checker.

transformers 5 holds a mixture-of-experts layer's experts fused in memory (`mlp.experts.gate_up_proj`
[E, 2F, H] with each expert's gate rows before its up rows, `mlp.experts.down_proj` [E, H, F]) and
names Mixtral's router `mlp.gate`; checkpoints, `save_pretrained` and megarl's weight pushes name
every expert's matrices (`mlp.experts.<e>.{gate,up,down}_proj.weight`, Mixtral
`block_sparse_moe.experts.<e>.{w1,w3,w2}.weight` and `block_sparse_moe.gate.weight`). SGLang loads
those names into its own fused parameters; these functions do the same for the CPU engine: a
pushed per-expert tensor lands in its slice of the fused parameter (`checkpoint_tensor`), and the
weights checker reports checkpoint names (`model_tensors`), which are what the trainer hashed.
Dense models pass through unchanged.

gpt-oss is the exception (`fused_on_disk`): its checkpoints hold the experts fused exactly as
transformers holds them (`mlp.experts.{gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias}`,
[E, H, 2F] gate/up interleaved, ...), and SGLang 0.5.23's GptOssForCausalLM loads only those names
(models/gpt_oss.py `_load_normal_weights`: `FusedMoE.make_expert_params_mapping_fused`; a
per-expert name matches no parameter and is skipped without a word). Its per-expert names are
therefore no tensors of the model here: a push naming them is refused, not forgiven.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Optional

import torch

_EXPERT = re.compile(r"^(?P<layer>.+\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>.+\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def fused_on_disk(model: torch.nn.Module) -> bool:
    """Whether the model's checkpoints name its fused expert tensors as it does (gpt-oss)."""
    return getattr(model.config, "model_type", "") == "gpt_oss"


def checkpoint_tensor(state: Mapping[str, torch.Tensor], name: str, fused: bool = False) -> Optional[torch.Tensor]:
    """The tensor of `state` (a model's `state_dict()`) that checkpoint name `name` denotes: the tensor
    itself, or a view into the fused expert parameter (writing into it writes the model). None if the
    model has no such tensor. `fused`: the model's checkpoints hold its experts fused (`fused_on_disk`):
    only the model's own names are its tensors."""
    if name in state or fused:
        return state.get(name)
    router = _MIXTRAL_ROUTER.match(name)
    if router:
        return state.get(f"{router['layer']}.mlp.gate.weight")
    expert = _EXPERT.match(name)
    if not expert:
        return None
    e, part, fused_prefix = int(expert["expert"]), _PART[expert["proj"]], f"{expert['layer']}.mlp.experts."
    fused = state.get(fused_prefix + ("down_proj" if part == "down" else "gate_up_proj"))
    if fused is None or fused.dim() != 3 or e >= fused.shape[0]:
        return None
    if part == "down":
        return fused[e]
    rows = fused.shape[1] // 2
    return fused[e, :rows] if part == "gate" else fused[e, rows:]


def checkpoint_named_tensors(named: Iterable[tuple[str, torch.Tensor]], mixtral: bool = False,
                             fused: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` (the model's own names) under checkpoint names: each fused expert parameter as its
    experts' matrices (views), Mixtral's in-memory names as its checkpoints'. `mixtral`: the model's
    `config.model_type == "mixtral"`; `fused`: its checkpoints hold the experts fused (`fused_on_disk`),
    the names pass unchanged."""
    for name, tensor in named:
        layer, _, leaf = name.rpartition(".mlp.")
        if fused:
            yield name, tensor
        elif layer and leaf in ("experts.gate_up_proj", "experts.down_proj") and tensor.dim() == 3:
            block = "block_sparse_moe" if mixtral else "mlp"
            parts = ("down",) if leaf == "experts.down_proj" else ("gate", "up")
            for e in range(tensor.shape[0]):
                for index, part in enumerate(parts):
                    proj = _MIXTRAL_NAMES[part] if mixtral else f"{part}_proj"
                    rows = tensor.shape[1] // len(parts)
                    yield f"{layer}.{block}.experts.{e}.{proj}.weight", tensor[e, index * rows:(index + 1) * rows]
        elif mixtral and layer and leaf == "gate.weight":
            yield f"{layer}.block_sparse_moe.gate.weight", tensor
        else:
            yield name, tensor


def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's checker walks: `named_parameters()` then `named_buffers()` (tied tensors once),
    under checkpoint names: a transformers model's fused MoE experts as each expert's matrices, the
    names the trainer pushed and hashed (`checkpoint_named_tensors`)."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    return list(checkpoint_named_tensors(named, mixtral=getattr(model.config, "model_type", "") == "mixtral",
                                         fused=fused_on_disk(model)))
