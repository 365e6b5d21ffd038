"""The resharder: a rank's megatron shards -> full HF-named tensors, in buckets.

Each pipeline stage works on its own layers, independently of the other stages (no funnel through
one rank). Within a stage, in each sending data-parallel replica (`ParallelGroups`: replica 0, or
every replica for its own share of the buckets):

1. `local_params` lists the rank's parameters under their global TE-spelled megatron names
   (`module.` prefixes stripped, local layer index -> `layer_number - 1`); a tied embedding's
   output-layer copy on the last stage is left out (it is the embedding).
2. `plan_buckets` packs them, in order, into buckets of at most `bucket_bytes` of *gathered*
   megatron tensors (a larger parameter gets a bucket of its own). Every TP rank makes the same plan.
3. Per bucket, every TP rank sends its TP-split shards (one flat byte buffer) to TP rank 0 with one
   `gather`; replicated parameters are not sent. The gather of bucket k+1 runs while bucket k is
   pushed.
4. TP rank 0 (the stage's emitter) merges the shards (`bridge.unshard_tp`: GLU-aware), converts
   each parameter with `WeightMap.to_hf` (QKV and fc1 split, vocab padding dropped) and writes the
   HF tensors (cast to the wire dtype, if one is set) into one flat byte buffer, laid out as
   SGLang's `flattened_bucket`.

Extra memory, allocated once per pass and reused by every bucket: on the emitter, one bucket of
gathered shards, one bucket of HF tensors and its own share of a bucket (1/TP), plus the
conversion's per-parameter temporaries; on the other TP ranks, their share of a bucket.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.bridge import WeightMap
from megarl.bridge.errors import ConversionError
from megarl.bridge.lora import is_lora_param
from megarl.bridge.mapping import TPSplit, tp_split
from megarl.bridge.sharding import layer_index, shift_layer, unshard_tp
from megarl.rollout.weight_group import TensorSlot, bucket_layout, dtype_name, unflatten_tensors
from megarl.sync.groups import ParallelGroups

ROW_ALIGN = 16  # bytes; every gathered row and every tensor in it starts aligned for its dtype


@dataclass(frozen=True)
class LocalParam:
    name: str  # global megatron name, TE spelling
    tensor: torch.Tensor  # this rank's shard of it (the live parameter, detached)
    split: TPSplit


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module wrappers (each keeps it in `.module`)."""
    while isinstance(getattr(module, "module", None), torch.nn.Module):
        module = module.module
    return module


def local_params(model_chunks: Sequence[torch.nn.Module], weights: WeightMap, tp_size: int) -> list[LocalParam]:
    """This rank's parameters, chunk by chunk in registration order, under global names.

    Checks each shard's shape against the full shape the bridge expects for this TP size. MoE
    experts are split over TP like the dense MLP (with EP = 1 expert TP is TP)."""
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
            name = weights.canonical(name)
            if weights.is_tied_output_copy(name):
                continue
            split = tp_split(name)
            expected = list(weights.mcore_shape(name))
            if split.dim is not None:
                expected[split.dim] //= tp_size
            if list(param.shape) != expected:
                raise ConversionError(
                    f"{local_name} ({name}): local shape {list(param.shape)} does not match {expected}, the "
                    f"bridge's full shape {list(weights.mcore_shape(name))} at TP={tp_size}"
                )
            out.append(LocalParam(name, param.detach(), split))
    return out


def _align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class PlannedParam:
    param: LocalParam
    gather_offset: Optional[int]  # byte offset in the gathered row; None: not gathered (replicated, or TP=1)


@dataclass(frozen=True)
class BucketPlan:
    params: tuple[PlannedParam, ...]
    row_bytes: int  # bytes each TP rank sends (its TP-split shards, padded to ROW_ALIGN)
    hf_slots: tuple[TensorSlot, ...]  # where each HF tensor goes in the bucket's flat buffer

    @property
    def hf_bytes(self) -> int:
        return self.hf_slots[-1].end


def gathered_bytes(param: LocalParam, tp_size: int) -> int:
    """Bytes of the full (TP-gathered) megatron tensor."""
    local = param.tensor.numel() * param.tensor.element_size()
    return local if param.split.dim is None else local * tp_size


def plan_buckets(
    params: Sequence[LocalParam], weights: WeightMap, tp_size: int, bucket_bytes: int,
    dtype: Optional[torch.dtype] = None,
) -> list[BucketPlan]:
    """Pack `params` in order into buckets of at most `bucket_bytes` gathered bytes (a larger
    parameter gets a bucket of its own). The HF tensors get `dtype` (None: their parameter's).
    Within a bucket, the gathered row and the HF buffer hold wider dtypes first, so every tensor
    starts aligned for its dtype."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[list[LocalParam]] = []
    size = 0
    for param in params:
        nbytes = gathered_bytes(param, tp_size)
        if not groups or size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(param)
        size += nbytes
    return [_plan(group, weights, tp_size, dtype) for group in groups]


def _plan(group: list[LocalParam], weights: WeightMap, tp_size: int, dtype: Optional[torch.dtype]) -> BucketPlan:
    offsets: dict[str, int] = {}
    row = 0
    for param in sorted(group, key=lambda p: -p.tensor.element_size()):
        if param.split.dim is not None and tp_size > 1:
            offsets[param.name] = row
            row += param.tensor.numel() * param.tensor.element_size()
    hf = sorted(
        [(hf_name, dtype or param.tensor.dtype) for param in group for hf_name in weights.hf_names_of(param.name)],
        key=lambda item: -item[1].itemsize,
    )
    slots = bucket_layout(
        [n for n, _ in hf], [dtype_name(d) for _, d in hf], [list(weights.hf_shape(n)) for n, _ in hf]
    )
    planned = tuple(PlannedParam(p, offsets.get(p.name)) for p in group)
    return BucketPlan(planned, _align(row), tuple(slots))


@dataclass
class HFBucket:
    """One bucket of full HF tensors, packed in `flat` (uint8) as `slots` say."""

    index: int  # within this pipeline stage's buckets (all replicas' shares)
    count: int  # buckets of this stage (all replicas' shares)
    flat: torch.Tensor
    slots: tuple[TensorSlot, ...]

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

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
    peak_buffer_bytes: int = 0  # the pass's buffers: gathered rows + HF buffer (emitter), send buffer
    buckets: int = 0
    bytes: int = 0  # HF bytes produced


class _Buffers:
    """The byte buffers of one pass, sized for its largest bucket and reused by every bucket:
    fresh memory for each bucket would cost page faults on a CPU (on a GPU the caching allocator
    reuses blocks anyway). `send`: this rank's shards of a bucket; `rows`: the gathered shards of
    every TP rank (emitter); `flat`: the HF tensors (emitter)."""

    def __init__(self, plans: Sequence[BucketPlan], tp_size: int, is_emitter: bool, device: torch.device):
        row_bytes = max(p.row_bytes for p in plans)

        def buffer(nbytes: int, needed: bool) -> Optional[torch.Tensor]:
            return torch.empty(nbytes, dtype=torch.uint8, device=device) if needed and nbytes else None

        self.send = buffer(row_bytes, True)
        self.rows = buffer(tp_size * row_bytes, is_emitter)
        self.flat = buffer(max(p.hf_bytes for p in plans), is_emitter)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in (self.send, self.rows, self.flat) if b is not None)


def _refuse_expert_parallel(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Raise on every rank of an expert-parallel model: each EP rank holds only its experts, and
    gathering them across EP ranks is not implemented (a sync would send half a model)."""
    for chunk in model_chunks:
        ep = getattr(getattr(unwrap(chunk), "config", None), "expert_model_parallel_size", 1)
        if ep > 1:
            raise NotImplementedError(
                f"weight sync of an expert-parallel model (expert_model_parallel_size={ep}) is not implemented: "
                "each EP rank holds only its experts; use actor_rollout_ref.actor.megatron.expert_model_parallel_size=1"
            )


class Resharder:
    """Streams this stage's HF buckets (this replica's share of them). All TP ranks of a sending
    replica iterate `buckets()` together (they run the gathers); only the emitter (TP rank 0)
    receives buckets, the others get none. Replicas that do not send get none and take part in nothing.

    A caller must exhaust the iterator on every gathering rank, even after its own failure,
    or the stage's other TP ranks block in their next gather. A bucket's memory is reused for the
    next one: a caller that keeps tensors past the next iteration must copy them."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], weights: WeightMap, groups: ParallelGroups,
                 bucket_bytes: int, dtype: Optional[torch.dtype] = None):
        """`dtype`: of the HF tensors (e.g. the servers' bf16 for an fp32 actor); None: each parameter's."""
        self.model_chunks, self.weights, self.groups = list(model_chunks), weights, groups
        _refuse_expert_parallel(self.model_chunks)
        self.bucket_bytes, self.dtype = bucket_bytes, dtype
        self.timings = ReshardTimings()

    def plan(self) -> list[BucketPlan]:
        params = local_params(self.model_chunks, self.weights, self.groups.tp_size)
        return plan_buckets(params, self.weights, self.groups.tp_size, self.bucket_bytes, self.dtype)

    def buckets(self) -> Iterator[HFBucket]:
        self.timings = t = ReshardTimings()
        if not self.groups.gathers:
            return
        every = self.plan()
        mine = [(k, plan) for k, plan in enumerate(every) if self.groups.owns(k, len(every))]
        if not mine:
            return
        plans = [plan for _, plan in mine]
        buffers = _Buffers(plans, self.groups.tp_size, self.groups.is_emitter, plans[0].params[0].param.tensor.device)
        t.peak_buffer_bytes = buffers.nbytes
        work = self._start_gather(plans[0], buffers)
        for i, (k, plan) in enumerate(mine):
            started = time.perf_counter()
            if work is not None:
                work.wait()
            waited = time.perf_counter()
            t.gather_s += waited - started
            bucket = self._convert(plan, buffers, k, len(every)) if self.groups.is_emitter else None
            # the rows are converted: the next bucket's gather overlaps this bucket's push
            work = self._start_gather(plans[i + 1], buffers) if i + 1 < len(plans) else None
            if bucket is not None:
                t.convert_s += time.perf_counter() - waited
                t.buckets += 1
                t.bytes += bucket.nbytes
                yield bucket

    # ---------------------------------------------------------------- internals
    def _start_gather(self, plan: BucketPlan, buffers: _Buffers):
        """Send this rank's TP-split shards of `plan` to the emitter (async); None if there are none."""
        g = self.groups
        gathered = [p for p in plan.params if p.gather_offset is not None]
        if not gathered:
            return None
        send = buffers.send[: plan.row_bytes]
        for planned in gathered:
            tensor = planned.param.tensor
            start = planned.gather_offset
            send[start : start + tensor.numel() * tensor.element_size()].copy_(tensor.reshape(-1).view(torch.uint8))
        rows = list(self._rows(plan, buffers)) if g.is_emitter else None
        return dist.gather(send, rows, dst=g.tp_emitter_rank, group=g.tp_group, async_op=True)

    def _rows(self, plan: BucketPlan, buffers: _Buffers) -> torch.Tensor:
        """[tp, row_bytes]: row r holds TP rank r's shards of `plan` (emitter)."""
        return buffers.rows[: self.groups.tp_size * plan.row_bytes].view(self.groups.tp_size, plan.row_bytes)

    def _convert(self, plan: BucketPlan, buffers: _Buffers, index: int, count: int) -> HFBucket:
        flat = buffers.flat[: plan.hf_bytes]
        targets = dict(unflatten_tensors(flat, list(plan.hf_slots)))
        rows = self._rows(plan, buffers) if buffers.rows is not None else None
        for planned in plan.params:
            param = planned.param
            if planned.gather_offset is None:
                full = param.tensor
            else:
                n = param.tensor.numel() * param.tensor.element_size()
                start = planned.gather_offset
                pieces = [rows[r, start : start + n].view(param.tensor.dtype).view(param.tensor.shape)
                          for r in range(self.groups.tp_size)]
                full = unshard_tp(param.split, pieces, param.name)
            for hf_name, tensor in self.weights.to_hf(param.name, full):
                targets[hf_name].copy_(tensor)
        return HFBucket(index, count, flat, plan.hf_slots)
