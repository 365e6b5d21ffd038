"""Pure TP / PP / VPP sharding of megatron-core parameters (no process groups, no megatron import).

A model chunk is identified by (pp_rank, vp_stage); its `GPTModel` numbers its layers locally
from 0. With an even split, chunk (p, v) holds `L / (pp * vpp)` layers starting at global layer
`v * L / vpp + p * L / (pp * vpp)` (megatron-core `get_transformer_layer_offset`). The embedding
lives in chunk (0, 0), the final norm and output layer in chunk (pp-1, vpp-1); with tied
embeddings and more than one chunk, the last chunk keeps its own copy of the embedding as
`output_layer.weight`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Mapping

import torch

from megarl.bridge.arch import ModelArch
from megarl.bridge.errors import ConversionError
from megarl.bridge.mapping import (
    EMBEDDING,
    OUTPUT_LAYER,
    TPSplit,
    WeightMap,
    canonical_name,
    is_extra_state,
    match_mcore,
)

Spelling = Literal["te", "local"]


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (1: no virtual pipeline)

    def __post_init__(self):
        for field in ("tp", "pp", "vpp"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ConversionError(f"parallel layout: {field} must be a positive integer, got {getattr(self, field)!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ConversionError("parallel layout: vpp > 1 needs pp > 1 (megatron's interleaved schedule)")

    def chunks(self) -> list[tuple[int, int]]:
        """(pp_rank, vp_stage) of every model chunk."""
        return [(p, v) for p in range(self.pp) for v in range(self.vpp)]

    def is_first(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == 0 and vp_stage == 0

    def is_last(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == self.pp - 1 and vp_stage == self.vpp - 1

    def __str__(self) -> str:
        return f"TP={self.tp} PP={self.pp} VPP={self.vpp}"


def check_layout(arch: ModelArch, layout: ParallelLayout) -> None:
    """Raise `ConversionError` naming the config field that `layout` cannot split evenly."""
    chunks = layout.pp * layout.vpp
    if arch.num_layers % chunks:
        raise ConversionError(
            f"{layout}: num_hidden_layers={arch.num_layers} is not a multiple of pp*vpp={chunks}"
        )
    for field, value in (
        ("num_attention_heads", arch.num_attention_heads),
        ("intermediate_size", arch.ffn_hidden_size),
    ):
        if value % layout.tp:
            raise ConversionError(f"{layout}: {field}={value} is not a multiple of tp={layout.tp}")
    ng = arch.num_query_groups
    if ng % layout.tp and layout.tp % ng:
        raise ConversionError(
            f"{layout}: num_key_value_heads={ng} must be a multiple or a divisor of tp={layout.tp}"
        )


def layer_offset(num_layers: int, layout: ParallelLayout, pp_rank: int, vp_stage: int) -> int:
    """Global index of the first layer of chunk (pp_rank, vp_stage) (even split)."""
    per_chunk = num_layers // (layout.pp * layout.vpp)
    return vp_stage * (num_layers // layout.vpp) + pp_rank * per_chunk


_LAYER = re.compile(r"^((?:module\.)*decoder\.layers\.)(\d+)\.")


def layer_index(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m.group(2)) if m else None


def shift_layer(name: str, offset: int) -> str:
    """Add `offset` to the layer index of a `decoder.layers.{i}.` name (local <-> global)."""
    return _LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}.", name, count=1)


def local_spelling(te_name: str) -> str:
    """The local-spec (non-TE) spelling of a TE-spelled megatron name."""
    rule, layer = match_mcore(te_name)
    return rule.local_alias.format(i=layer) if rule.local_alias else te_name


# ------------------------------------------------------------------------------------------ TP
def shard_tp(split: TPSplit, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of a full tensor."""
    if split.dim is None or tp == 1:
        return full
    if full.shape[split.dim] % (tp * split.stride):
        raise ConversionError(
            f"dim {split.dim} of size {full.shape[split.dim]} cannot be split into {tp} x {split.stride} parts"
        )
    parts = full.chunk(split.stride, dim=split.dim)
    return torch.cat([p.chunk(tp, dim=split.dim)[rank] for p in parts], dim=split.dim).contiguous()


def unshard_tp(split: TPSplit, shards: list[torch.Tensor], name: str = "tensor") -> torch.Tensor:
    """The full tensor from the pieces of every TP rank (rank order). Replicated pieces must agree."""
    if split.dim is None:
        for rank, shard in enumerate(shards[1:], start=1):
            if not torch.equal(shard, shards[0]):
                raise ConversionError(f"{name}: replicated on TP ranks but rank {rank} differs from rank 0")
        return shards[0]
    if len(shards) == 1:
        return shards[0]
    halves = [s.chunk(split.stride, dim=split.dim) for s in shards]
    return torch.cat([h[part] for part in range(split.stride) for h in halves], dim=split.dim)


# ------------------------------------------------------------------------------------------ PP / VPP
def chunk_param_names(weights: WeightMap, layout: ParallelLayout, pp_rank: int, vp_stage: int) -> list[str]:
    """Global TE names of the parameters chunk (pp_rank, vp_stage) holds, in checkpoint order.
    Includes the tied-embedding copy `output_layer.weight` of the last chunk when there is one."""
    arch = weights.arch
    first, last = layout.is_first(pp_rank, vp_stage), layout.is_last(pp_rank, vp_stage)
    start = layer_offset(arch.num_layers, layout, pp_rank, vp_stage)
    stop = start + arch.num_layers // (layout.pp * layout.vpp)
    names = []
    for name in weights.mcore_names():
        layer = layer_index(name)
        if layer is not None:
            if start <= layer < stop:
                names.append(name)
        elif name == EMBEDDING and first or name != EMBEDDING and last:
            names.append(name)
    if last and arch.lm_head_tied and not first:
        names.append(OUTPUT_LAYER)
    return names


def _full_tensor(full: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    key = EMBEDDING if name == OUTPUT_LAYER and OUTPUT_LAYER not in full else name
    if key not in full:
        raise ConversionError(f"full state dict has no {key!r}")
    return full[key]


def shard_model(
    weights: WeightMap,
    full: Mapping[str, torch.Tensor],
    layout: ParallelLayout,
    spelling: Spelling = "local",
) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Split full megatron tensors (global TE names, padded vocab) into every rank's chunk state
    dicts: {(pp_rank, vp_stage, tp_rank): {local name: tensor}}, with local layer indices and the
    requested spelling, as a live `GPTModel` of that chunk names its parameters."""
    check_layout(weights.arch, layout)
    out = {}
    for pp_rank, vp_stage in layout.chunks():
        offset = layer_offset(weights.arch.num_layers, layout, pp_rank, vp_stage)
        names = chunk_param_names(weights, layout, pp_rank, vp_stage)
        for tp_rank in range(layout.tp):
            sd = {}
            for name in names:
                local = shift_layer(name, -offset)
                if spelling == "local":
                    local = local_spelling(local)
                split = weights.tp_split(EMBEDDING if weights.is_tied_output_copy(name) else name)
                sd[local] = shard_tp(split, _full_tensor(full, name), layout.tp, tp_rank)
            out[(pp_rank, vp_stage, tp_rank)] = sd
    return out


def merge_model(
    weights: WeightMap,
    shards: Mapping[tuple[int, int, int], Mapping[str, torch.Tensor]],
    layout: ParallelLayout,
) -> dict[str, torch.Tensor]:
    """Inverse of `shard_model`: every rank's chunk state dict -> full tensors under global TE
    names. Accepts TE or local spelling and `module.` prefixes, ignores `_extra_state` entries and
    drops a tied output-layer copy after checking it equals the embedding."""
    missing = [key for key in ((p, v, t) for p, v in layout.chunks() for t in range(layout.tp)) if key not in shards]
    if missing:
        raise ConversionError(f"{layout}: no state dict for (pp, vp, tp) rank(s) {missing}")
    full: dict[str, torch.Tensor] = {}
    tied_copy = None
    for pp_rank, vp_stage in layout.chunks():
        offset = layer_offset(weights.arch.num_layers, layout, pp_rank, vp_stage)
        per_rank = [
            {canonical_name(k): v for k, v in shards[(pp_rank, vp_stage, t)].items() if not is_extra_state(k)}
            for t in range(layout.tp)
        ]
        expected = chunk_param_names(weights, layout, pp_rank, vp_stage)
        local_expected = {shift_layer(n, -offset) for n in expected}
        for t, sd in enumerate(per_rank):
            if set(sd) != local_expected:
                raise ConversionError(
                    f"chunk (pp={pp_rank}, vp={vp_stage}, tp={t}): parameters {sorted(set(sd) ^ local_expected)} "
                    f"differ from what {layout} expects"
                )
        for local in per_rank[0]:
            name = shift_layer(local, offset)
            split = weights.tp_split(EMBEDDING if weights.is_tied_output_copy(name) else name)
            tensor = unshard_tp(split, [sd[local] for sd in per_rank], name)
            if weights.is_tied_output_copy(name):
                tied_copy = tensor
            else:
                full[name] = tensor
    if tied_copy is not None and not torch.equal(tied_copy, full[EMBEDDING]):
        raise ConversionError("tied embeddings: the last stage's output_layer.weight differs from the embedding")
    return full

