"""Pure TP / PP / VPP sharding of megatron-core parameters (no process groups, no megatron import).

A model chunk is identified by (pp_rank, vp_stage); its `GPTModel` numbers its layers locally
from 0. Pipeline stage p holds `stage_layers(L, layout)[p]` layers: L / pp each, or, with
megatron's uneven split (`num_layers_in_first_pipeline_stage` / `..._last_...`), the given counts on
the first and last stages and the rest evenly on the middle ones. Chunk (p, v) holds 1 / vpp of
its stage's layers, starting at global layer `v * L / vpp + sum(stage_layers[:p]) / vpp`
(megatron-core `get_transformer_layer_offset`, transformer_layer.py). With megatron's
`account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split` the embedding /
the loss counts as one more layer of the split: L + 1 (or + 2) layers cut evenly into pp x vpp
chunks, chunk (0, 0) then holding one layer less (the embedding) and chunk (pp-1, vpp-1) one less
(the loss) (`chunk_layers`, `layer_offset`). The embedding
lives in chunk (0, 0), the final norm and output layer in chunk (pp-1, vpp-1); with tied
embeddings and more than one chunk, the last chunk keeps its own copy of the embedding as
`output_layer.weight`.

MoE: with expert parallelism (EP) each rank holds `num_experts / ep` experts, numbered locally
from 0 (`local_experts.<k>` is global expert `ep_rank * num_experts / ep + k`); an expert's
weights are split over expert-TP (ETP) ranks, which are the TP ranks when ETP = TP and absent
when ETP = 1 (megatron-core 0.16.1 `parallel_state` orders both `tp-...`). Dense parameters are
the same on every EP rank. A rank's state dict is keyed (pp_rank, vp_stage, tp_rank), plus
ep_rank when EP > 1 (`rank_keys`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Mapping, Optional

import torch

from megarl.bridge.arch import ModelArch
from megarl.bridge.errors import ConversionError
from megarl.bridge.mapping import (
    EMBEDDING,
    OUTPUT_LAYER,
    REPLICATED,
    TPSplit,
    WeightMap,
    is_extra_state,
    match_mcore,
)
from megarl.bridge.grouped_experts import grouped_expert_name
from megarl.bridge.moe import expert_index, shift_expert

# the names of a live chunk: transformer-engine layers, local layers, or TE layers with grouped-GEMM
# experts (`mlp.experts.linear_fc1.weight<k>`, megarl.bridge.grouped_experts)
Spelling = Literal["te", "local", "grouped"]


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1  # model chunks per pipeline rank (1: no virtual pipeline)
    ep: int = 1  # expert parallel: ranks the experts of a layer are spread over
    etp: int = 0  # expert tensor parallel: 1, or 0 meaning TP (megatron's default)
    # megatron's uneven pipeline split: layers of the first / last stage (None: its share of an even split)
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    # megatron's account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split: the
    # embedding / the loss counts as one layer of the even split (module docstring)
    embedding_in_split: bool = False
    loss_in_split: bool = False

    def __post_init__(self):
        for field in ("tp", "pp", "vpp", "ep"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ConversionError(f"parallel layout: {field} must be a positive integer, got {getattr(self, field)!r}")
        if self.vpp > 1 and self.pp == 1:
            raise ConversionError("parallel layout: vpp > 1 needs pp > 1 (megatron's interleaved schedule)")
        for field, name in UNEVEN_FIELDS.items():
            value = getattr(self, field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConversionError(f"parallel layout: {name}={value!r} must be a positive integer")
            if self.pp == 1:
                raise ConversionError(f"parallel layout: {name}={value} needs pp > 1 (one stage holds every layer)")
        if (self.embedding_in_split or self.loss_in_split) and (
                self.first_stage_layers is not None or self.last_stage_layers is not None):
            # megatron-core 0.16.1 transformer_config.py __post_init__: "num_layers_in_first_pipeline_stage and
            # num_layers_in_last_pipeline_stage cannot be set at the same time with account_for_..."
            raise ConversionError(f"parallel layout: {' / '.join(UNEVEN_FIELDS.values())} cannot be set together with "
                                  f"{' / '.join(SPLIT_FIELDS.values())} (megatron-core's rule)")
        if self.etp not in (0, 1, self.tp):
            raise ConversionError(f"parallel layout: etp={self.etp} must be 1 or tp={self.tp}")
        if self.expert_tp != self.tp and self.ep == 1:
            # megatron-core 0.16.1 marks expert weights as expert parameters only when EP > 1
            # (tensor_parallel/layers.py:829/886): with EP = 1 and ETP != TP, DP ranks holding
            # different expert shards would average their gradients (moe-on-cpu.md).
            raise ConversionError(f"parallel layout: etp={self.etp} differs from tp={self.tp} with ep=1, which "
                                  "megatron-core trains wrongly; use etp=tp or ep > 1")

    @property
    def expert_tp(self) -> int:
        """Expert-TP size: ranks one expert's weights are split over."""
        return self.etp or self.tp

    def rank_keys(self) -> list[tuple[int, ...]]:
        """Every state-dict key: (pp_rank, vp_stage, tp_rank), with ep_rank appended when EP > 1."""
        return [self.key(p, v, t, e) for p, v in self.chunks() for t in range(self.tp) for e in range(self.ep)]

    def key(self, pp_rank: int, vp_stage: int, tp_rank: int, ep_rank: int = 0) -> tuple[int, ...]:
        return (pp_rank, vp_stage, tp_rank, ep_rank) if self.ep > 1 else (pp_rank, vp_stage, tp_rank)

    def chunks(self) -> list[tuple[int, int]]:
        """(pp_rank, vp_stage) of every model chunk."""
        return [(p, v) for p in range(self.pp) for v in range(self.vpp)]

    def is_first(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == 0 and vp_stage == 0

    def is_last(self, pp_rank: int, vp_stage: int) -> bool:
        return pp_rank == self.pp - 1 and vp_stage == self.vpp - 1

    def __str__(self) -> str:
        experts = f" EP={self.ep} ETP={self.expert_tp}" if self.ep > 1 or self.etp else ""
        uneven = "".join(f" {name}={getattr(self, field)}" for field, name in UNEVEN_FIELDS.items()
                         if getattr(self, field) is not None)
        uneven += "".join(f" {name}=True" for field, name in SPLIT_FIELDS.items() if getattr(self, field))
        return f"TP={self.tp} PP={self.pp} VPP={self.vpp}{experts}{uneven}"


# ParallelLayout field -> megatron-core's TransformerConfig field
UNEVEN_FIELDS = {"first_stage_layers": "num_layers_in_first_pipeline_stage",
                 "last_stage_layers": "num_layers_in_last_pipeline_stage"}
SPLIT_FIELDS = {"embedding_in_split": "account_for_embedding_in_pipeline_split",
                "loss_in_split": "account_for_loss_in_pipeline_split"}


def stage_layers(num_layers: int, layout: ParallelLayout) -> list[int]:
    """Layers of each pipeline stage, as megatron-core splits them (transformer_config.py "Uneven PP"
    checks, transformer_layer.py `get_transformer_layer_offset`): the first and last stages hold
    `layout.first_stage_layers` / `last_stage_layers` where set, the middle stages the rest evenly;
    each stage's layers must divide by VPP. Raises `ConversionError` naming the fields."""
    if layout.embedding_in_split or layout.loss_in_split:
        per_chunk = _split_chunk_layers(num_layers, layout)
        stages = [per_chunk * layout.vpp] * layout.pp
        stages[0] -= layout.embedding_in_split
        stages[-1] -= layout.loss_in_split
        return stages
    first, last = layout.first_stage_layers, layout.last_stage_layers
    middle_stages = layout.pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if first is None and last is None:
        if num_layers % (layout.pp * layout.vpp):
            raise ConversionError(f"{layout}: num_hidden_layers={num_layers} is not a multiple of "
                                  f"pp*vpp={layout.pp * layout.vpp}")
        return [num_layers // layout.pp] * layout.pp
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages) or (
            middle_stages and middle_layers % middle_stages):
        raise ConversionError(f"{layout}: the {middle_layers} layers of num_hidden_layers={num_layers} left for the "
                              f"{middle_stages} middle pipeline stage(s) do not split evenly over them (megatron-core's rule)")
    stages = [middle_layers // middle_stages if middle_stages else 0] * layout.pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    if any(n % layout.vpp for n in stages):
        raise ConversionError(f"{layout}: pipeline stages of {stages} layers cannot each be cut into vpp={layout.vpp} "
                              "equal chunks (megatron-core's rule)")
    return stages


def check_layout(arch: ModelArch, layout: ParallelLayout) -> None:
    """Raise `ConversionError` naming the config field that `layout` cannot split evenly."""
    stage_layers(arch.num_layers, layout)
    moe = arch.moe
    tp_fields = [("num_attention_heads", arch.num_attention_heads)]
    if arch.has_dense_layers:
        tp_fields.append(("intermediate_size", arch.ffn_hidden_size))
    if arch.mla is not None:  # megatron's MLA splits its down projections' outputs over TP (column-parallel)
        if arch.mla.q_lora_rank is not None:
            tp_fields.append(("q_lora_rank", arch.mla.q_lora_rank))
        tp_fields.append(("kv_lora_rank + qk_rope_head_dim", arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim))
    if moe is None:
        if layout.ep > 1:
            raise ConversionError(f"{layout}: expert parallelism (ep={layout.ep}) needs an MoE model; "
                                  f"{arch.model_type} is dense")
    else:
        if moe.shared_expert:
            tp_fields.append(("shared_expert_intermediate_size", moe.shared_expert_ffn_hidden_size))
        if moe.num_experts % layout.ep:
            raise ConversionError(f"{layout}: num_experts={moe.num_experts} is not a multiple of ep={layout.ep}")
        if arch.linear_bias and layout.expert_tp > 1:  # transformer_config.py: "Bias in Moe is only supported when ETP==1"
            raise ConversionError(f"{layout}: {arch.model_type}'s experts have biases, which megatron-core supports "
                                  "only at expert TP size 1 (set etp=1)")
        if moe.expert_ffn_hidden_size % layout.expert_tp:
            raise ConversionError(f"{layout}: the expert MLP width {moe.expert_ffn_hidden_size} is not a multiple "
                                  f"of the expert TP size {layout.expert_tp}")
    for field, value in tp_fields:
        if value % layout.tp:
            raise ConversionError(f"{layout}: {field}={value} is not a multiple of tp={layout.tp}")
    ng = arch.num_query_groups
    if ng % layout.tp and layout.tp % ng:
        raise ConversionError(
            f"{layout}: num_key_value_heads={ng} must be a multiple or a divisor of tp={layout.tp}"
        )


def _split_chunk_layers(num_layers: int, layout: ParallelLayout) -> int:
    """Layers per chunk of the even split of the layers plus the embedding and/or the loss (with
    `embedding_in_split` / `loss_in_split`), before chunk (0, 0) and chunk (pp-1, vpp-1) each give
    one back: megatron-core 0.16.1 transformer_block.py `get_num_layers_to_build` and
    transformer_config.py `__post_init__` (L + 1 or L + 2 must divide by pp, its quotient by vpp)."""
    total = num_layers + layout.embedding_in_split + layout.loss_in_split
    if total % layout.pp or (total // layout.pp) % layout.vpp:
        raise ConversionError(f"{layout}: num_hidden_layers={num_layers} plus the embedding / loss counted in the "
                              f"split ({total}) do not cut evenly into pp={layout.pp} stages of vpp={layout.vpp} "
                              "chunks (megatron-core's rule)")
    return total // layout.pp // layout.vpp


def layer_offset(num_layers: int, layout: ParallelLayout, pp_rank: int, vp_stage: int) -> int:
    """Global index of the first layer of chunk (pp_rank, vp_stage)."""
    if layout.embedding_in_split or layout.loss_in_split:  # transformer_layer.py get_transformer_layer_offset
        per_chunk = _split_chunk_layers(num_layers, layout)
        offset = (vp_stage * layout.pp + pp_rank) * per_chunk
        return offset - (layout.embedding_in_split and (pp_rank, vp_stage) != (0, 0))
    stages = stage_layers(num_layers, layout)
    return vp_stage * (num_layers // layout.vpp) + sum(stages[:pp_rank]) // layout.vpp


def chunk_layers(num_layers: int, layout: ParallelLayout, pp_rank: int, vp_stage: int) -> int:
    """Layers of model chunk (pp_rank, vp_stage)."""
    if layout.embedding_in_split or layout.loss_in_split:  # transformer_block.py get_num_layers_to_build
        first, last = layout.is_first(pp_rank, vp_stage), layout.is_last(pp_rank, vp_stage)
        return (_split_chunk_layers(num_layers, layout) - (layout.embedding_in_split and first)
                - (layout.loss_in_split and last))
    return stage_layers(num_layers, layout)[pp_rank] // layout.vpp


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


def experts_per_rank(weights: WeightMap, layout: ParallelLayout) -> int:
    return weights.arch.moe.num_experts // layout.ep if weights.arch.moe else 0


def expert_split(weights: WeightMap, layout: ParallelLayout, name: str) -> TPSplit:
    """How a global megatron name is split over the TP ranks: an expert over its ETP ranks, which
    are the TP ranks (ETP = TP) or none (ETP = 1: replicated on the TP ranks)."""
    if expert_index(name) is not None and layout.expert_tp == 1:
        return REPLICATED
    return weights.tp_split(EMBEDDING if weights.is_tied_output_copy(name) else name)


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
def chunk_param_names(
    weights: WeightMap, layout: ParallelLayout, pp_rank: int, vp_stage: int, ep_rank: int = 0
) -> list[str]:
    """Global TE names of the parameters chunk (pp_rank, vp_stage) holds on EP rank `ep_rank`, in
    checkpoint order. Includes the tied-embedding copy `output_layer.weight` of the last chunk
    when there is one."""
    arch = weights.arch
    first, last = layout.is_first(pp_rank, vp_stage), layout.is_last(pp_rank, vp_stage)
    start = layer_offset(arch.num_layers, layout, pp_rank, vp_stage)
    stop = start + chunk_layers(arch.num_layers, layout, pp_rank, vp_stage)
    per_rank = experts_per_rank(weights, layout)
    names = []
    for name in weights.mcore_names():
        layer, expert = layer_index(name), expert_index(name)
        if expert is not None and not ep_rank * per_rank <= expert < (ep_rank + 1) * per_rank:
            continue
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


def local_name(weights: WeightMap, layout: ParallelLayout, name: str, layer_shift: int, ep_rank: int) -> str:
    """The chunk-local name of global `name`: layer index minus `layer_shift`, expert index local to `ep_rank`."""
    local = shift_layer(name, -layer_shift)
    if expert_index(name) is not None:
        local = shift_expert(local, -ep_rank * experts_per_rank(weights, layout))
    return local


def shard_model(
    weights: WeightMap,
    full: Mapping[str, torch.Tensor],
    layout: ParallelLayout,
    spelling: Spelling = "local",
) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    """Split full megatron tensors (global TE names, padded vocab) into every rank's chunk state
    dicts: {layout.key(pp_rank, vp_stage, tp_rank, ep_rank): {local name: tensor}}, with local
    layer (and expert) indices and the requested spelling, as a live `GPTModel` of that chunk
    names its parameters."""
    check_layout(weights.arch, layout)
    out = {}
    for pp_rank, vp_stage in layout.chunks():
        offset = layer_offset(weights.arch.num_layers, layout, pp_rank, vp_stage)
        for ep_rank in range(layout.ep):
            names = chunk_param_names(weights, layout, pp_rank, vp_stage, ep_rank)
            for tp_rank in range(layout.tp):
                sd = {}
                for name in names:
                    local = local_name(weights, layout, name, offset, ep_rank)
                    if spelling == "local":
                        local = local_spelling(local)
                    elif spelling == "grouped":
                        local = grouped_expert_name(local)
                    sd[local] = shard_tp(expert_split(weights, layout, name), _full_tensor(full, name), layout.tp, tp_rank)
                out[layout.key(pp_rank, vp_stage, tp_rank, ep_rank)] = sd
    return out


def merge_model(
    weights: WeightMap,
    shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]],
    layout: ParallelLayout,
) -> dict[str, torch.Tensor]:
    """Inverse of `shard_model`: ranks' chunk state dicts -> full tensors under global TE names.

    `shards` needs, per chunk, every TP rank (for dense parameters) and every EP rank with each of
    its expert-TP ranks (for experts), but not every (tp, ep) pair: with ETP = 1 megatron places
    EP ranks independently of TP ranks. Copies held by several ranks must agree. Accepts every
    `Spelling` and `module.` prefixes, ignores `_extra_state` entries and drops a tied
    output-layer copy after checking it equals the embedding."""
    missing = sorted({(p, v, t) for p, v in layout.chunks() for t in range(layout.tp)} - {tuple(k[:3]) for k in shards})
    if missing:
        raise ConversionError(f"{layout}: no state dict for (pp, vp, tp) rank(s) {missing}")
    full: dict[str, torch.Tensor] = {}
    tied_copy = None
    for pp_rank, vp_stage in layout.chunks():
        offset = layer_offset(weights.arch.num_layers, layout, pp_rank, vp_stage)
        held: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (tp, ep) -> canonical local state dict
        for key, sd in shards.items():
            if tuple(key[:2]) == (pp_rank, vp_stage):
                tp_rank, ep_rank = key[2], key[3] if len(key) > 3 else 0
                held[(tp_rank, ep_rank)] = {weights.canonical(k): v for k, v in sd.items() if not is_extra_state(k)}
        pieces: dict[str, dict[int, list[torch.Tensor]]] = {}  # global name -> tp rank -> copies
        for (tp_rank, ep_rank), sd in held.items():
            expected = {local_name(weights, layout, n, offset, ep_rank): n
                        for n in chunk_param_names(weights, layout, pp_rank, vp_stage, ep_rank)}
            if set(sd) != set(expected):
                raise ConversionError(
                    f"chunk (pp={pp_rank}, vp={vp_stage}, tp={tp_rank}, ep={ep_rank}): parameters "
                    f"{sorted(set(sd) ^ set(expected))} differ from what {layout} expects"
                )
            for local, name in expected.items():
                pieces.setdefault(name, {}).setdefault(tp_rank, []).append(sd[local])
        expected_names = {n for ep in range(layout.ep) for n in chunk_param_names(weights, layout, pp_rank, vp_stage, ep)}
        if set(pieces) != expected_names:
            raise ConversionError(f"chunk (pp={pp_rank}, vp={vp_stage}) of {layout}: no state dict holds "
                                  f"{sorted(expected_names - set(pieces))[:3]}")
        for name, by_tp in pieces.items():
            split = expert_split(weights, layout, name)
            for tp_rank, copies in by_tp.items():
                if any(not torch.equal(c, copies[0]) for c in copies[1:]):
                    raise ConversionError(f"{name}: the copies held by the ranks of tp rank {tp_rank} differ")
            if split.dim is not None and sorted(by_tp) != list(range(layout.tp)):
                raise ConversionError(f"{name}: state dicts of tp ranks {sorted(by_tp)} given, {layout} needs all")
            tensor = unshard_tp(split, [by_tp[t][0] for t in sorted(by_tp)], name)
            if weights.is_tied_output_copy(name):
                tied_copy = tensor
            else:
                full[name] = tensor
    if tied_copy is not None and not torch.equal(tied_copy, full[EMBEDDING]):
        raise ConversionError("tied embeddings: the last stage's output_layer.weight differs from the embedding")
    return full

