"""The resharder: a rank's megatron shards -> full HF-named tensors, in buckets.

Each pipeline stage works on its own layers, independently of the other stages (no funnel through
one rank). Within a stage, in each sending data-parallel replica (`ParallelGroups`: replica 0, or
every replica for its own share of the buckets):

1. `local_params` lists the rank's parameters under their global TE-spelled megatron names
   (`module.` prefixes stripped, local layer index -> `layer_number - 1`); a tied embedding's
   output-layer copy on the last stage is left out (it is the embedding).
2. `plan_buckets` packs them, in order, into buckets of at most `bucket_bytes` of *gathered*
   megatron tensors (a larger parameter gets a bucket of its own). Every TP rank makes the same plan.
3. Per bucket, every other TP rank sends its TP-split shards (one flat byte buffer) to TP rank 0,
   which receives each rank's straight into that rank's row of a preallocated buffer (point-to-point:
   gloo's `gather` would receive into a fresh buffer of its own and copy it out); replicated
   parameters are not sent. The gather of bucket k+1 runs while bucket k is pushed.
4. TP rank 0 (the stage's emitter) writes each HF tensor (cast to the wire dtype, if one is set)
   straight from the shards into its slot of one flat byte buffer, laid out as SGLang's
   `flattened_bucket`: every transform of `WeightMap.to_hf` (QKV and fc1 split, vocab padding
   dropped) is a selection of rows of the TP-merged tensor (`WeightMap.hf_rows`), so the plan
   turns it into runs of rows (`Copy`) of the ranks' shards; the emitter's own shards are read
   from its parameters. No merged tensor is ever built, but for the weights sent in block FP8
   (`quantized`, `actor_rollout_ref.rollout.quantization=fp8`): each is merged whole at the
   parameter's precision, then quantized into its values' and scales' slots (`megarl.rollout.fp8`).

Experts at EP > 1 (`groups.py`): each rank lists its local experts under their global names
(local expert k of EP rank r is global expert `r * experts_per_rank + k`) and plans them after the
dense buckets, split over its expert-TP ranks as the dense ones are over the TP ranks; the ranks
of one expert-TP group make the same plan. Per expert bucket, the expert-TP ranks send their
shards to their rank 0, the EP rank's expert emitter, which converts and pushes them: every EP
rank emits its own experts, in parallel with the other emitters, and no rank receives another EP
rank's experts. Every EP rank plans the same number X of expert buckets (their experts have the
same shapes), so a stage's buckets are numbered without a collective: the D dense buckets
0..D-1, then EP rank r's expert buckets D + r * X .. D + (r + 1) * X - 1, of D + ep_size * X.

Fused experts (gpt-oss, `megarl.bridge.fused_experts`): SGLang 0.5.23's GptOssForCausalLM loads a
layer's experts only as four tensors holding all of them (`mlp.experts.gate_up_proj` [E, H, 2F]
gate/up interleaved, `gate_up_proj_bias` [E, 2F], `down_proj` [E, F, H], `down_proj_bias` [E, H]:
models/gpt_oss.py `_load_normal_weights` with `FusedMoE.make_expert_params_mapping_fused`; each is
copied whole into the layer's parameter by `FusedMoE.weight_loader_fused`, and any other expert
name is skipped without a word). So a layer's experts are one unit no bucket splits
(`loaded_together`), the HF tensors of such a bucket are the fused ones, and each expert's tensors
are written straight into their strided views of them (`fused_experts.expert_view`): no per-expert
copy is made. At EP > 1 the expert buckets are gathered over the EP group (`ParallelGroups.
fused_experts`: each EP rank sends its whole experts, row r holding EP rank r's) to EP rank 0,
which alone emits them, numbered D .. D + X - 1: its buffers hold one bucket of every EP rank's
experts (with the default bucket size, a layer's), as the HF tensors must.

Extra memory, allocated once per pass and reused by every bucket: on the emitter, the other ranks'
shards of one bucket ((TP-1)/TP of its gathered bytes) and one bucket of HF tensors, so at most 2
buckets (a bucket: `bucket_bytes`, or the largest parameter if larger); on the other TP ranks,
their share of a bucket. The conversion allocates nothing of a bucket's size (with FP8 weights: one
merged HF weight at a time, at its parameter's precision, while it is quantized).

A QAT actor's weights (`fake_quant`, the push): each rank sends, and the emitter converts, its shard's
NVFP4 values (`megarl.algos.nvfp4`, one shard's copy at a time), the values its forward computes with.
"""
from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.algos.nvfp4 import PARAM_MARK, nvfp4_dequantized
from megarl.bridge import WeightMap
from megarl.bridge.errors import ConversionError
from megarl.bridge.fused_experts import PER_EXPERT, expert_view, fused_shape, fused_source, fuses_experts
from megarl.bridge.lora import is_lora_param
from megarl.bridge.mapping import EMBEDDING, REPLICATED, TPSplit, mtp_as_decoder, tp_split
from megarl.bridge.moe import expert_index, shift_expert
from megarl.bridge.sharding import layer_index, shift_layer
from megarl.rollout import fp8
from megarl.rollout.weight_group import TensorSlot, bucket_layout, dtype_name, unflatten_tensors
from megarl.sync.groups import ParallelGroups

ROW_ALIGN = 16  # bytes; every gathered row and every tensor in it starts aligned for its dtype


@dataclass(frozen=True)
class LocalParam:
    name: str  # global megatron name, TE spelling (an expert at EP > 1: its global expert index)
    tensor: torch.Tensor  # this rank's shard of it (the live parameter, detached)
    split: TPSplit  # over the TP ranks (an expert at EP > 1: over its expert-TP ranks)
    expert: bool = False  # an expert at EP > 1: gathered over the expert-TP group, not the TP group
    nvfp4_group: Optional[int] = None  # a QAT actor's fake-quantized weight: its NVFP4 group (engines.megatron.qat)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module wrappers (each keeps it in `.module`)."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def local_params(model_chunks: Sequence[torch.nn.Module], weights: WeightMap, tp_size: int,
                 ep_size: int = 1, etp_size: int = 1, ep_rank: int = 0) -> list[LocalParam]:
    """This rank's parameters, chunk by chunk in registration order, under global names (experts
    at EP > 1: local expert k of EP rank `ep_rank` is global expert ep_rank * E / ep_size + k).

    Checks each shard's shape against the full shape the bridge expects for this TP size. MoE
    experts are split over TP like the dense MLP with EP = 1 (expert TP is TP then), over
    `etp_size` ranks with EP > 1 (replicated on the TP ranks when it is 1)."""
    out = []
    for chunk in model_chunks:
        model = unwrap(chunk)
        for local_name, param in model.named_parameters():
            name = local_name
            layer = layer_index(local_name)
            if layer is not None:
                name = shift_layer(local_name, model.decoder.layers[layer].layer_number - 1 - layer)
            if is_lora_param(name):
                continue  # adapters are pushed merged into their base weights (engines.megatron.lora.merged)
            if not weights.mtp and mtp_as_decoder(name, 0) is not None:
                continue  # the MTP block, for servers that do not draft with it (weight_sync.servers_weight_map)
            if name == EMBEDDING and not model.pre_process:
                continue  # the MTP block's copy of the embedding on the last stage (GPTModel mtp_process): the first's

            name = weights.canonical(name)
            if weights.is_tied_output_copy(name):
                continue
            expert = ep_size > 1 and expert_index(name) is not None
            split, ranks = tp_split(name), tp_size
            if expert:
                name = shift_expert(name, ep_rank * (weights.arch.moe.num_experts // ep_size))
                split, ranks = (tp_split(name) if etp_size > 1 else REPLICATED), etp_size
            expected = list(weights.mcore_shape(name))
            if split.dim is not None:
                expected[split.dim] //= ranks
            if list(param.shape) != expected:
                raise ConversionError(
                    f"{local_name} ({name}): local shape {list(param.shape)} does not match {expected}, the "
                    f"bridge's full shape {list(weights.mcore_shape(name))} split over {ranks} rank(s)"
                )
            out.append(LocalParam(name, param.detach(), split, expert, getattr(param, PARAM_MARK, None)))
    return out


def _align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class Copy:
    """One run of a direct write: `length` slices along `dim` of the parameter's shard from rank
    `piece` (of the ranks it is split over), from index `src`, into its HF tensor number `hf`
    (`hf_names_of` order) from index `dst`."""

    hf: int
    piece: int
    src: int
    dst: int
    length: int
    dim: int = 0


def write_runs(copies: Sequence[Copy], pieces: Sequence[torch.Tensor], hf: Sequence[torch.Tensor]) -> None:
    """Write the HF tensors `hf` (`hf_names_of` order) from the shards `pieces` (rank order) as `copies` say."""
    for c in copies:
        hf[c.hf].narrow(c.dim, c.dst, c.length).copy_(pieces[c.piece].narrow(c.dim, c.src, c.length))


@dataclass(frozen=True)
class PlannedParam:
    param: LocalParam
    gather_offset: Optional[int]  # byte offset in the gathered row; None: not gathered (replicated, or TP=1)
    copies: tuple[Copy, ...] = ()  # how its HF tensors are written from the shards (`copy_runs`)


@functools.lru_cache(maxsize=65536)  # pure (frozen arguments, immutable result): each push plans again
def copy_runs(weights: WeightMap, name: str, split: TPSplit, pieces: int) -> tuple[Copy, ...]:
    """The runs that write `name`'s HF tensors from its `pieces` shards, in rank order (1: the
    full tensor), split as `split` says: rank k's shard of a stride-s split holds part p of the
    merged tensor's s parts at its rows [p*c, (p+1)*c) (`sharding.unshard_tp`). A split over dim 1
    has one HF tensor, the merged one (megatron's row-parallel weights). Memoised: every push plans
    its buckets again (the plans hold the live parameters), and these runs were most of that."""
    full_rows = weights.mcore_shape(name)[0]
    if split.dim == 1:
        (_, rows), = weights.hf_rows(name)
        if not torch.equal(rows, torch.arange(full_rows)):
            raise ConversionError(f"{name}: split over dim 1, but its HF tensor is not the merged tensor")
        cols = weights.mcore_shape(name)[1] // pieces
        return tuple(Copy(0, k, 0, k * cols, cols, dim=1) for k in range(pieces))
    stride = split.stride if split.dim == 0 else 1
    c = full_rows // pieces // stride  # rows of one part of one shard
    out = []
    for hf, (_, rows) in enumerate(weights.hf_rows(name)):
        part, within = rows // (pieces * c), rows % (pieces * c)
        piece, local = within // c, part * c + within % c
        starts = torch.ones(len(rows), dtype=torch.bool)  # a run starts where the shard or the row sequence breaks
        starts[1:] = (piece[1:] != piece[:-1]) | (local[1:] != local[:-1] + 1)
        bounds = starts.nonzero().flatten().tolist() + [len(rows)]
        out += [Copy(hf, int(piece[a]), int(local[a]), a, b - a) for a, b in zip(bounds, bounds[1:])]
    return tuple(out)


@dataclass(frozen=True)
class BucketPlan:
    params: tuple[PlannedParam, ...]
    row_bytes: int  # bytes each rank of the gather sends (its split shards, padded to ROW_ALIGN)
    hf_slots: tuple[TensorSlot, ...]  # where each HF tensor goes in the bucket's flat buffer
    ranks: int = 1  # ranks of the gather: TP, or (expert bucket) expert-TP
    expert: bool = False  # gathered over the expert-TP group (fused experts at EP > 1: the EP group)
    quantized: frozenset[str] = frozenset()  # its HF weights sent in block FP8 (values and weight_scale_inv slots)
    across_ep: bool = False  # fused experts at EP > 1: row r of the gather holds EP rank r's experts, whole

    @property
    def hf_bytes(self) -> int:
        return self.hf_slots[-1].end


def gathered_bytes(param: LocalParam, tp_size: int, etp_size: int = 1, ep_gather: int = 1) -> int:
    """Bytes of the gathered megatron tensor: the full one, gathered over the TP ranks (an expert
    at EP > 1: over its `etp_size` expert-TP ranks; fused experts: its copies from `ep_gather` EP ranks)."""
    local = param.tensor.numel() * param.tensor.element_size()
    if param.expert and ep_gather > 1:
        return local * ep_gather
    return local if param.split.dim is None else local * (etp_size if param.expert else tp_size)


_MLA_DOWN = re.compile(r"^decoder\.layers\.(\d+)\.self_attention\.linear_(?:q|kv)_down_proj\.weight$")


def loaded_together(weights: WeightMap, name: str) -> Optional[str]:
    """A key shared by the parameters SGLang must receive in one `update_weights` call, else None: a
    layer's MLA down projections with q LoRA (HF q_a_proj, kv_a_proj_with_mqa), which SGLang 0.5.23
    fuses into `fused_qkv_a_proj_with_mqa` only when both arrive in one `load_weights` call
    (models/deepseek_common/deepseek_weight_loader.py `do_load_weights`: `cached_a_proj` is local to
    the call; one half alone is cached and dropped, leaving the old weights); a layer's fused
    experts (gpt-oss: every expert's tensors make its four fused HF tensors, module docstring)."""
    if fuses_experts(weights.arch) and expert_index(name) is not None:
        return f"layer {layer_index(name)} experts"
    if weights.arch.mla is None or weights.arch.mla.q_lora_rank is None:
        return None
    m = _MLA_DOWN.match(name)
    return f"layer {m.group(1)} a_proj" if m else None


def _units(params: Sequence[LocalParam], weights: WeightMap) -> list[list[LocalParam]]:
    """`params` in order, cut into runs no bucket may split: a single parameter, or everything from
    the first to the last parameter of one `loaded_together` key."""
    keys = [loaded_together(weights, param.name) for param in params]
    last = {key: i for i, key in enumerate(keys) if key is not None}
    units: list[list[LocalParam]] = []
    end = -1  # the last index of the open run
    for i, (param, key) in enumerate(zip(params, keys)):
        if i > end:
            units.append([])
        units[-1].append(param)
        end = max(end, last.get(key, i))
    return units


def plan_buckets(
    params: Sequence[LocalParam], weights: WeightMap, tp_size: int, bucket_bytes: int,
    dtype: Optional[torch.dtype] = None, etp_size: int = 1, quantized: frozenset[str] = frozenset(),
    ep_gather: int = 1,
) -> list[BucketPlan]:
    """Pack `params` in order into buckets of at most `bucket_bytes` gathered bytes (a larger
    parameter gets a bucket of its own; parameters SGLang must load in one call, `loaded_together`,
    share one): the dense parameters first, then this EP rank's experts
    at EP > 1 (`LocalParam.expert`, gathered over `etp_size` ranks; fused experts with `ep_gather`
    > 1: over the `ep_gather` EP ranks, each sending its own experts whole). The HF tensors get `dtype`
    (None: their parameter's), but those named in `quantized`, which go as block FP8: e4m3 values
    and their float32 `weight_scale_inv` (`megarl.rollout.fp8`), both in the bucket. Within a bucket,
    the gathered row and the HF buffer hold wider dtypes first, so every tensor starts aligned for
    its dtype."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plans = []
    for expert in (False, True):
        groups: list[list[LocalParam]] = []
        size = 0
        for unit in _units([p for p in params if p.expert == expert], weights):
            nbytes = sum(gathered_bytes(param, tp_size, etp_size, ep_gather) for param in unit)
            if not groups or size + nbytes > bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].extend(unit)
            size += nbytes
        across_ep = expert and ep_gather > 1
        ranks = (ep_gather if across_ep else etp_size) if expert else tp_size
        plans += [_plan(group, weights, ranks, expert, dtype, quantized, across_ep) for group in groups]
    return plans


def _hf_entries(weights: WeightMap, param: LocalParam, dtype: Optional[torch.dtype],
               quantized: frozenset[str]) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of every HF tensor `param` is sent as: each of its HF tensors in `dtype`
    (None: the parameter's), or, named in `quantized`, its FP8 values and their scales."""
    out = []
    for name in weights.hf_names_of(param.name):
        shape = list(weights.hf_shape(name))
        if fuses_experts(weights.arch) and PER_EXPERT.match(name):
            if name in quantized:
                raise ConversionError(f"{name}: fused experts (gpt-oss) cannot be sent in block FP8")
            out.append((fused_source(name)[0], dtype or param.tensor.dtype,
                        list(fused_shape(name, tuple(shape), weights.arch.moe.num_experts))))
        elif name in quantized:
            out += [(name, fp8.FP8_DTYPE, shape), (fp8.scale_name(name), torch.float32, list(fp8.scale_shape(shape)))]
        else:
            out.append((name, dtype or param.tensor.dtype, shape))
    return out


def _plan(group: list[LocalParam], weights: WeightMap, ranks: int, expert: bool,
          dtype: Optional[torch.dtype], quantized: frozenset[str], across_ep: bool = False) -> BucketPlan:
    """`across_ep`: every parameter is gathered whole from each of the `ranks` EP ranks (fused experts)."""
    offsets: dict[str, int] = {}
    row = 0
    for param in sorted(group, key=lambda p: -p.tensor.element_size()):
        if ranks > 1 and (param.split.dim is not None or across_ep):
            offsets[param.name] = row
            row += param.tensor.numel() * param.tensor.element_size()
    entries = [entry for param in group for entry in _hf_entries(weights, param, dtype, quantized)]
    hf = sorted({entry[0]: entry for entry in entries}.values(), key=lambda entry: -entry[1].itemsize)  # fused: once
    slots = bucket_layout([n for n, _, _ in hf], [dtype_name(d) for _, d, _ in hf], [s for _, _, s in hf])
    pieces = 1 if across_ep else ranks
    planned = tuple(PlannedParam(p, offsets.get(p.name),
                                 copy_runs(weights, p.name, p.split, pieces if p.name in offsets else 1))
                    for p in group)
    return BucketPlan(planned, _align(row), tuple(slots), ranks, expert,
                      frozenset(n for p in group for n in weights.hf_names_of(p.name) if n in quantized), across_ep)


@dataclass
class HFBucket:
    """One bucket of full HF tensors, packed in `flat` (uint8) as `slots` say."""

    index: int  # within this pipeline stage's buckets (all emitters' of the stage: unique in it)
    count: int  # buckets of this stage (all emitters')
    flat: torch.Tensor
    slots: tuple[TensorSlot, ...]
    owned: bool = False  # `flat` is this bucket's own memory (the resharder's `hf_memory`), never reused
    final: bool = False  # the last bucket this rank emits in this pass

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs; the tensors are views into `flat`."""
        return unflatten_tensors(self.flat, list(self.slots))

    def request_fields(self) -> dict[str, list]:
        """`names`, `dtypes`, `shapes` of SGLang's weight-update requests."""
        return {
            "names": [s.name for s in self.slots],
            "dtypes": [dtype_name(s.dtype) for s in self.slots],
            "shapes": [list(s.shape) for s in self.slots],
        }


@dataclass
class ReshardTimings:
    """What this rank spent in one pass (emitters: waiting for gathers, and converting)."""

    gather_s: float = 0.0
    convert_s: float = 0.0
    peak_buffer_bytes: int = 0  # the pass's buffers: the other ranks' rows + HF buffer (emitter), send buffer (others)
    buckets: int = 0
    bytes: int = 0  # HF bytes produced


class _Buffers:
    """The byte buffers of one pass, sized for its largest bucket and reused by every bucket:
    fresh memory for each bucket would cost page faults on a CPU (on a GPU the caching allocator
    reuses blocks anyway). `send`: this rank's shards of a bucket it does not emit; `rows`: the
    shards of the other ranks of a gather, rank r's in row r - 1 (emitter: its own shards are its
    parameters); `flat`: the HF tensors (emitter)."""

    def __init__(self, plans: Sequence[tuple[BucketPlan, bool]], device: torch.device, with_flat: bool = True):
        """`plans`: (plan, whether this rank emits it) of every bucket this rank takes part in;
        `with_flat`: False when each bucket gets memory of its own (`Resharder.hf_memory`)."""
        emitted = [p for p, emits in plans if emits]

        def buffer(nbytes: int) -> Optional[torch.Tensor]:
            return torch.empty(nbytes, dtype=torch.uint8, device=device) if nbytes else None

        self.send = buffer(max((p.row_bytes for p, emits in plans if not emits), default=0))
        self.rows = buffer(max(((p.ranks - 1) * p.row_bytes for p in emitted), default=0))
        self.flat = buffer(max((p.hf_bytes for p in emitted), default=0)) if with_flat else None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in (self.send, self.rows, self.flat) if b is not None)


class Resharder:
    """Streams this rank's HF buckets: its stage's dense buckets (its replica's share of them) on
    TP rank 0 of a sending replica, its EP rank's expert buckets on expert-TP rank 0 of expert-DP
    replica 0 (`groups.py`). All TP ranks of a sending replica iterate `buckets()` together (they
    run the gathers), and with EP > 1 every rank of expert-DP replica 0 (the expert gathers, each
    over its expert-TP group); only emitters receive buckets, the others get none. Ranks that
    gather nothing get none and take part in nothing.

    A caller must exhaust the iterator on every gathering rank, even after its own failure,
    or the other ranks of its gathers block in their next one. A bucket's memory is reused for the
    next one (a caller that keeps tensors past the next iteration must copy them), unless
    `hf_memory` gives each bucket memory of its own (`HFBucket.owned`): the resharder then holds no
    reference to a bucket once it yielded it, so a caller that drops it before asking for the next
    one holds one bucket at a time."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], weights: WeightMap, groups: ParallelGroups,
                 bucket_bytes: int, dtype: Optional[torch.dtype] = None,
                 hf_memory: Optional[Callable[[int], torch.Tensor]] = None, quantized: frozenset[str] = frozenset(),
                 fake_quant: bool = False):
        """`dtype`: of the HF tensors (e.g. the servers' bf16 for an fp32 actor); None: each parameter's.
        `hf_memory(nbytes)`: fresh uint8 memory for each bucket's HF tensors, handed to the caller
        (the tensor transport's shareable memory, sent without a copy); None: one reused buffer.
        `quantized`: the HF weights sent in block FP8 (`plan_buckets`), each quantized by the emitter
        from the whole HF tensor it merged from its gathered shards (never from a TP or EP shard, so
        no 128 x 128 block straddles two ranks' rows), at the parameter's own precision.
        `fake_quant`: a QAT actor's fake-quantized weights are sent as the values its forward computes
        with (`nvfp4_dequantized` of each rank's shard, as the forward quantizes it: the weight push);
        False: its full-precision master weights (the HF export)."""
        self.model_chunks, self.weights, self.groups = list(model_chunks), weights, groups
        self.fake_quant = fake_quant
        self.bucket_bytes, self.dtype, self.hf_memory = bucket_bytes, dtype, hf_memory
        self.quantized = frozenset(quantized)
        self.timings = ReshardTimings()
        if groups.fused_experts != fuses_experts(weights.arch):
            raise ValueError(f"resharder: groups.fused_experts is {groups.fused_experts}, but the model's experts are "
                             f"{'' if fuses_experts(weights.arch) else 'not '}sent fused (fused_experts.fuses_experts)")

    def plan(self) -> list[BucketPlan]:
        """This rank's plans: its stage's dense buckets, then its EP rank's expert buckets."""
        g = self.groups
        params = local_params(self.model_chunks, self.weights, g.tp_size, g.ep_size, g.etp_size, g.ep_rank)
        ep_gather = g.ep_size if g.fused_experts else 1
        return plan_buckets(params, self.weights, g.tp_size, self.bucket_bytes, self.dtype, g.etp_size, self.quantized,
                            ep_gather)

    def _takes_part(self, plan: BucketPlan, index: int, count: int) -> bool:
        g = self.groups
        return g.gathers_experts if plan.expert else g.gathers and g.owns(index, count)

    def _emits(self, plan: BucketPlan) -> bool:
        return self.groups.emits_experts if plan.expert else self.groups.emits_dense

    def _mine(self) -> tuple[int, list[tuple[int, BucketPlan]]]:
        """(the stage's bucket count, the (index, plan) of the buckets this rank takes part in),
        numbered as the module docstring says: dense 0..D-1, then EP rank r's expert buckets
        from D + r * X (fused experts: EP rank 0's of every EP rank's experts, from D)."""
        g = self.groups
        if not g.takes_part:
            return 0, []
        plans = self.plan()
        dense = [plan for plan in plans if not plan.expert]
        experts = [plan for plan in plans if plan.expert]
        emitting_ep_ranks, ep_rank = (1, 0) if g.fused_experts else (g.ep_size, g.ep_rank)
        count = len(dense) + emitting_ep_ranks * len(experts)
        numbered = list(enumerate(dense)) + [(len(dense) + ep_rank * len(experts) + j, plan)
                                             for j, plan in enumerate(experts)]
        return count, [(k, plan) for k, plan in numbered if self._takes_part(plan, k, count)]

    def steps(self) -> int:
        """How many items `buckets(every_step=True)` yields here: the buckets this rank takes part in
        (no collective: every rank plans alone)."""
        return len(self._mine()[1])

    def buckets(self, every_step: bool = False) -> Iterator[Optional[HFBucket]]:
        """This rank's buckets (emitter); `every_step`: also None for each bucket this rank gathers
        but does not emit, yielded once its part of that gather is done and the next one started,
        so that a caller may run collectives of its own between buckets in step with its peers."""
        self.timings = t = ReshardTimings()
        count, mine = self._mine()
        if not mine:
            return
        plans = [plan for _, plan in mine]
        emits = [(plan, self._emits(plan)) for plan in plans]
        final = max((i for i, (_, emitted) in enumerate(emits) if emitted), default=-1)
        buffers = _Buffers(emits, plans[0].params[0].param.tensor.device, with_flat=self.hf_memory is None)
        own = max((plan.hf_bytes for plan, emitted in emits if emitted), default=0) if self.hf_memory else 0
        t.peak_buffer_bytes = buffers.nbytes + own  # with hf_memory: one bucket's, if the caller keeps one at a time
        work = self._start_gather(plans[0], buffers)
        for i, (k, plan) in enumerate(mine):
            started = time.perf_counter()
            if work is not None:
                work.wait()
            waited = time.perf_counter()
            t.gather_s += waited - started
            bucket = self._convert(plan, buffers, k, count, i == final) if self._emits(plan) else None
            # the rows are converted: the next bucket's gather overlaps this bucket's push
            work = self._start_gather(plans[i + 1], buffers) if i + 1 < len(plans) else None
            if bucket is not None:
                t.convert_s += time.perf_counter() - waited
                t.buckets += 1
                t.bytes += bucket.nbytes
                yield bucket
                bucket = None  # hf_memory: the next bucket's memory must not meet this one's here
            elif every_step:
                yield None

    # ---------------------------------------------------------------- internals
    def _start_gather(self, plan: BucketPlan, buffers: _Buffers) -> Optional["_Gather"]:
        """Start moving `plan`'s shards to the emitter over the TP group (expert bucket: the
        expert-TP group): the emitter receives rank r's row into `rows[r - 1]`, every other rank
        packs its shards into `send` and sends it. None if nothing is gathered."""
        g = self.groups
        gathered = [p for p in plan.params if p.gather_offset is not None]
        if not gathered:
            return None
        group = g.expert_gather_group if plan.expert else g.tp_group
        if self._emits(plan):
            rows = self._rows(plan, buffers)
            ops = [dist.P2POp(dist.irecv, rows[r - 1], dist.get_global_rank(group, r), group)
                   for r in range(1, plan.ranks)]
        else:
            send = buffers.send[: plan.row_bytes]
            for planned in gathered:
                tensor = self._values(planned.param)
                start = planned.gather_offset
                send[start : start + tensor.numel() * tensor.element_size()].copy_(tensor.reshape(-1).view(torch.uint8))
            emitter = g.expert_emitter_rank if plan.expert else g.tp_emitter_rank
            ops = [dist.P2POp(dist.isend, send, emitter, group)]
        return _Gather(dist.batch_isend_irecv(ops))

    def _values(self, param: LocalParam) -> torch.Tensor:
        """What this rank sends of `param`: its shard, or with `fake_quant` a QAT weight's NVFP4 values."""
        if self.fake_quant and param.nvfp4_group is not None:
            return nvfp4_dequantized(param.tensor, param.nvfp4_group)
        return param.tensor

    def _rows(self, plan: BucketPlan, buffers: _Buffers) -> torch.Tensor:
        """[ranks - 1, row_bytes]: row r - 1 holds rank r's shards of `plan` (TP, or expert-TP, rank) (emitter)."""
        return buffers.rows[: (plan.ranks - 1) * plan.row_bytes].view(plan.ranks - 1, plan.row_bytes)

    def _pieces(self, plan: BucketPlan, planned: PlannedParam, rows: Optional[torch.Tensor]) -> list:
        """The shards of `planned`, in rank order: the emitter's own (row 0 of its group) is its
        parameter, the others are views into `rows`."""
        tensor = self._values(planned.param)
        if planned.gather_offset is None:
            return [tensor]
        start, n = planned.gather_offset, tensor.numel() * tensor.element_size()
        return [tensor if r == 0 else rows[r - 1, start : start + n].view(tensor.dtype).view(tensor.shape)
                for r in range(plan.ranks)]

    def _sources(self, plan: BucketPlan, planned: PlannedParam, rows: Optional[torch.Tensor]) -> list:
        """(global megatron name, its shards in rank order) of what `planned` brings: itself, or
        (`across_ep`) each EP rank's expert in its place, whole (EP rank r's local expert k is global
        expert r * E / ep_size + k; the emitter, EP rank 0, plans under its own, global 0..)."""
        pieces = self._pieces(plan, planned, rows)
        if not plan.across_ep:
            return [(planned.param.name, pieces)]
        per_rank = self.weights.arch.moe.num_experts // plan.ranks
        return [(shift_expert(planned.param.name, r * per_rank), [piece]) for r, piece in enumerate(pieces)]

    def _convert(self, plan: BucketPlan, buffers: _Buffers, index: int, count: int, final: bool) -> HFBucket:
        flat = buffers.flat[: plan.hf_bytes] if self.hf_memory is None else self.hf_memory(plan.hf_bytes)
        targets = dict(unflatten_tensors(flat, list(plan.hf_slots)))
        rows = self._rows(plan, buffers) if plan.row_bytes else None
        fused_writes: dict[str, int] = {}  # fused HF tensor -> per-expert tensors written into it
        for planned in plan.params:
            tensor = planned.param.tensor
            for mcore_name, pieces in self._sources(plan, planned, rows):
                names = self.weights.hf_names_of(mcore_name)
                # a quantized weight is merged whole at the parameter's precision first, then quantized into its slots
                merged = {n: torch.empty(self.weights.hf_shape(n), dtype=tensor.dtype, device=tensor.device)
                          for n in names if n in plan.quantized}
                outs = [merged.get(n) if n in merged else self._target(targets, n, fused_writes) for n in names]
                write_runs(planned.copies, pieces, outs)
                for name, whole in merged.items():
                    values, scale_inv = fp8.quantize(whole)
                    targets[name].copy_(values)
                    targets[fp8.scale_name(name)].copy_(scale_inv)
        for name, written in fused_writes.items():
            expected = self.weights.arch.moe.num_experts * (2 if "gate_up" in name else 1)
            if written != expected:
                raise ConversionError(f"{name}: {written} per-expert tensors written into it, expected {expected}: "
                                      "a bucket must hold all of a layer's experts")
        return HFBucket(index, count, flat, plan.hf_slots, owned=self.hf_memory is not None, final=final)

    def _target(self, targets: dict[str, torch.Tensor], name: str, fused_writes: dict[str, int]) -> torch.Tensor:
        """Where HF tensor `name` is written: its slot, or a fused expert's view into its fused tensor's slot."""
        if name in targets or not (fuses_experts(self.weights.arch) and PER_EXPERT.match(name)):
            return targets[name]
        fused, expert, proj, _ = fused_source(name)
        fused_writes[fused] = fused_writes.get(fused, 0) + 1
        return expert_view(targets[fused][expert], proj)


class _Gather:
    """The point-to-point transfers of one bucket's gather, waited on together."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
