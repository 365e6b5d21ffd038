"""Per-TP-rank copies of each bucket for the colocated tensor transport.

SGLang 0.5.23's TP worker r opens entry r of `serialized_named_tensors`, and entry r must be
serialised by the process whose copy of the bucket lives on r's own GPU (a CUDA IPC handle opens
only there; `sync/colocation.py`). So the bucket an emitter gathered reaches every actor rank
colocated with a server TP rank, each serialises its own copy, and the emitter posts the request
with entry r from actor rank `peers[s][r]`.

The relay runs in rounds interleaved with the stream (`WeightSync._stream`: one round per
resharder step, on every rank of the actor's world). In each round every emitter, in global-rank
order (the same order on every rank: the collectives line up without threads), takes one step
with its bucket of the round, if it has one:

    header   broadcast_object from the emitter: the bucket's slots, size and `peers`; None: no bucket
    bytes    broadcast of the bucket's bytes: each rank receives into its own copy (its current
             GPU over NCCL on CUDA; a shared-memory file over gloo on CPU)
    entries  each rank in `peers` serialises its copy (SGLang's flattened bucket of CUDA IPC handles
             on GPU, torch.multiprocessing file names on CPU); gather_object to the emitter
    deliver  the emitter posts the request (or keeps the entries, for the commit)
    outcome  broadcast_object from the emitter: whether the servers answered

A failure (a serialisation on any rank, a server refusing a request) becomes that emitter's error,
and it relays nothing more in this push; every collective runs on a group made with the sync's
group timeout (`SyncConfig.group_timeout_s`).

Lifetimes, on every rank: a step's copy is dropped at the end of the step, once the servers
answered the request made from it; the commit bucket's copy once the commit was answered
(`release`); a copy whose request failed or timed out (the server may still read it) once the
push's failure is known (`reset`). So a rank holds at most one bucket copy in flight plus the
commit's (an emitter's own copy is the bucket the resharder wrote into shareable memory). Why dropping an answered copy is safe:
- CPU: the CPU engine has copied the tensors into its model before it answers
  (`rollout/cpu/server.py::load_tensor_payload` returns after `CpuEngine.load_weights`' `copy_`).
- GPU: SGLang may answer before its reads are done, but torch's CUDA IPC refcounting keeps a block
  alive for its consumer: a storage shared by handle gets a reference counter in shared memory;
  when the producer frees it while the counter is > 0, `CudaIPCSentDataDelete` moves it to the
  `CudaIPCSentDataLimbo` instead of returning it to the allocator (torch/csrc/CudaIPCTypes.cpp),
  and the consumer's deleter synchronises its current stream before decrementing the counter
  (torch/csrc/StorageSharing.cpp; `aten/src/ATen/cuda/detail/CUDAHooks.cpp` in newer torch), and
  `torch.cuda.ipc_collect()` frees the limbo's blocks whose counter reached 0
  (torch/multiprocessing/multiprocessing.md, "CUDA IPC Refcounting implementation explained").
  So on GPU a dropped copy's memory comes back when the server lets go of it (each step's
  `ipc_collect` reclaims what was let go so far), not at the drop itself; not measured here.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.rollout import tensor_payload
from megarl.rollout.control import ServerError
from megarl.rollout.weight_group import TensorSlot, unflatten_tensors

Entries = list[list[str]]  # entries[s][r]: server s's TP rank r's serialised copy


@dataclass
class Outgoing:
    """One bucket an emitter relays: its bytes (this emitter's own copy), their layout, and what
    to do with the entries (post them, or keep them for the commit; may raise)."""

    flat: torch.Tensor
    slots: tuple[TensorSlot, ...]
    peers: list[list[int]]  # peers[s][r]: the actor rank on server s's TP rank r's GPU (`colocation`)
    deliver: Callable[[Entries], None]
    commit: bool = False  # the coordinator's last bucket: its copies live until release()


def sglang_serialisation(patch_cuda_reductions: bool = True):
    """(SGLang's `MultiprocessingSerializer`, its `FlattenedTensorMetadata`), with torch's CUDA
    reductions patched to name GPUs by UUID (the server's CUDA_VISIBLE_DEVICES may differ) unless
    `patch_cuda_reductions` is False: SGLang 0.5.23's patched `reduce_tensor`
    (utils/patch_torch.py::_reduce_tensor_modified) rewrites argument 6 of every tensor's
    reduction, which only a CUDA tensor's has, so a CPU tensor then fails to pickle (IndexError)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError as e:
        raise RuntimeError(
            "the tensor transport on GPU serialises CUDA IPC handles with SGLang's own classes (its server "
            f"accepts no others); install the GPU extras: pip install -e '.[gpu]' ({type(e).__name__}: {e})"
        ) from e
    if patch_cuda_reductions:
        monkey_patch_torch_reductions()
    return MultiprocessingSerializer, FlattenedTensorMetadata


def serialise_copy(copy: torch.Tensor, slots: Sequence[TensorSlot]) -> tuple[str, Optional[str]]:
    """(entry, load_format) of one copy of a bucket, as this process shares it: a CUDA copy as
    SGLang's `flattened_bucket` of IPC handles, a CPU copy (in shared memory) as (name, tensor)
    views with load_format null."""
    if copy.is_cuda:
        return flattened_bucket_entry(copy, slots), "flattened_bucket"
    return tensor_payload.serialize(unflatten_tensors(copy, list(slots))), None


def flattened_bucket_entry(copy: torch.Tensor, slots: Sequence[TensorSlot]) -> str:
    """SGLang's `flattened_bucket` entry of one copy (uint8, laid out as `slots` say), serialised
    with SGLang's own serializer and metadata class (SGLang needed). A CUDA copy travels as IPC
    handles; a CPU copy must be in shared memory and serialised under
    `tensor_payload.file_system_sharing()` (tests/sglang push one so into a real server)."""
    serializer, metadata_class = sglang_serialisation(patch_cuda_reductions=copy.is_cuda)
    metadata = [metadata_class(name=s.name, shape=torch.Size(s.shape), dtype=s.dtype, start_idx=s.start,
                               end_idx=s.end, numel=s.end - s.start) for s in slots]
    return serializer.serialize({"flattened_tensor": copy, "metadata": metadata}, output_str=True)


def fresh_copy(flat: torch.Tensor) -> torch.Tensor:
    """A copy of `flat` in memory of its own that a server may open: a clone on its GPU, a
    shared-memory file on CPU."""
    return flat.clone() if flat.is_cuda else tensor_payload.shared_cpu_copy(flat)


def shareable_empty(nbytes: int, on_gpu: bool) -> torch.Tensor:
    """`nbytes` of uint8 memory a server may open: on this process's current GPU, or a
    shared-memory file (a relayed copy; a bucket the resharder writes for the tensor transport)."""
    if on_gpu:
        return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    with tensor_payload.file_system_sharing():
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def copies_on_gpu(parameter_device_types) -> bool:
    """Where the tensor transport's bucket copies live, from the device types of the actor's
    parameters ("cuda", "cpu", ...): on the GPU when the actor trains there, whatever else the host
    has. A CUDA IPC handle names GPU memory and opens only on that GPU (torch.multiprocessing, "CUDA
    in multiprocessing"); CPU copies are shared through this host's shared memory. The parameters
    are on their device at every push (offload brings them back first)."""
    return "cuda" in set(parameter_device_types)


def entries_for(peers: Sequence[Sequence[int]], by_rank: Sequence[object]) -> Entries:
    """entries[s][r] = the entry serialised by actor rank peers[s][r]; raises on a rank's error
    (a string starting 'error: ') or a missing entry."""
    failed = sorted({f"actor rank {k}: {by_rank[k][len('error: '):]}" for row in peers for k in row
                     if isinstance(by_rank[k], str) and by_rank[k].startswith("error: ")})
    if failed:
        raise RuntimeError(f"serialising the colocated copies failed: {'; '.join(failed)}")
    return [[by_rank[k] for k in row] for row in peers]


class IpcRelay:
    """Every actor rank's part in per-TP-rank copies. Make one on every rank together (collective
    over `world_group`, and `new_group` over the default group: a group of the world's ranks with
    the sync's group timeout, `timeout_s` seconds); per push, on every rank: `rounds` once, `round`
    that many times (one per resharder step), then `release` (push succeeded) or `reset` (it failed).

    Memory (every rank): the copy of the step running (one bucket), the commit bucket's copy until
    `release`, and the copies of requests that failed until `reset`."""

    def __init__(self, is_emitter: bool, on_gpu: bool, timeout_s: float, world_group=None):
        flags = [None] * dist.get_world_size(world_group)
        dist.all_gather_object(flags, (dist.get_rank(), is_emitter), group=world_group)
        members = [rank for rank, _ in flags]  # global ranks in world-group order: group rank = actor rank
        self.group = dist.new_group(members, timeout=timedelta(seconds=timeout_s))
        self.emitters = sorted(rank for rank, emits in flags if emits)  # global ranks: the steps' order
        self.rank = dist.get_rank(self.group)
        self.on_gpu = on_gpu
        self._step: list[torch.Tensor] = []  # the copies of the running step
        self._commit: list[torch.Tensor] = []  # the commit bucket's copies, alive until release()
        self._failed: list[torch.Tensor] = []  # copies of requests that failed, alive until reset()

    @property
    def in_flight(self) -> tuple[torch.Tensor, ...]:
        """This rank's copies a server may still read."""
        return tuple(self._step + self._commit + self._failed)

    def rounds(self, steps: int) -> int:
        """Every rank: the number of rounds of this push, the most `steps` (resharder steps) of any rank."""
        count = torch.tensor([steps], dtype=torch.int64)
        if self.on_gpu:  # NCCL reduces CUDA tensors only
            count = count.cuda()
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        return int(count.item())

    def round(self, mine: Optional[Outgoing] = None) -> Optional[str]:
        """Every rank, once per round: each emitter's step in global-rank order; `mine` is this
        rank's bucket of the round if it is an emitter (None: nothing this round, e.g. its stream
        ended or failed). Returns this rank's error (an emitter's: a failed delivery or
        serialisation anywhere in its step), or None."""
        error = None
        for emitter in self.emitters:
            is_mine = emitter == dist.get_rank()
            step_error = self._step_of(emitter, mine if is_mine else None)
            if is_mine:
                error = step_error
        return error

    def release(self) -> None:
        """Drop the commit bucket's copies (every rank, once the commit was answered)."""
        self._drop(self._commit)

    def reset(self) -> None:
        """Drop every copy, those of failed requests too (every rank, once the push's failure is
        known: the coordinator ended the servers' update sessions)."""
        every = self._step + self._commit + self._failed
        self._step, self._commit, self._failed = [], [], []
        self._drop(every)

    def _step_of(self, emitter: int, item: Optional[Outgoing]) -> Optional[str]:
        """One emitter's step; `item` on that emitter (None elsewhere, or nothing to relay).
        The step's copies are dropped once the request was answered; kept until `reset` if it
        failed (the server may still read them), until `release` if they are the commit's."""
        header = [None if item is None else (item.slots, item.flat.numel(), item.peers, item.commit)]
        dist.broadcast_object_list(header, src=emitter, group=self.group)
        if header[0] is None:
            return None
        slots, nbytes, peers, commit = header[0]
        copy = item.flat if item is not None else shareable_empty(nbytes, self.on_gpu)
        held = self._commit if commit else self._step
        held.append(copy)  # held before anything can fail
        dist.broadcast(copy, src=emitter, group=self.group)
        if copy.is_cuda:  # the bytes are in place before a handle leaves (the server reads on its own stream)
            torch.cuda.current_stream().synchronize()
        entry = None
        if any(self.rank in row for row in peers):
            try:
                entry, _ = serialise_copy(copy, slots)
            except Exception as e:  # reported to the emitter, which fails its stream
                entry = f"error: {type(e).__name__}: {e}"
        by_rank = [None] * dist.get_world_size(self.group) if item is not None else None
        dist.gather_object(entry, by_rank, dst=emitter, group=self.group)
        error = None
        if item is not None:
            try:
                item.deliver(entries_for(peers, by_rank))
            except Exception as e:  # ServerError names the server
                error = str(e) if isinstance(e, ServerError) else f"{type(e).__name__}: {e}"
        outcome = [error]  # every rank learns whether the servers answered for its copy
        dist.broadcast_object_list(outcome, src=emitter, group=self.group)
        if outcome[0] is not None and not commit:
            self._failed.append(copy)  # the server may still read it: kept until reset()
            self._step.clear()
        del copy
        self._drop(self._step)
        return error

    def _drop(self, copies: list[torch.Tensor]) -> None:
        """Free copies the servers answered for. CPU: a server that answered has copied the tensors
        into its model (`rollout/cpu/server.py::load_tensor_payload` returns after
        `CpuEngine.load_weights`' `copy_`). GPU: after this process's work on them is done
        (`synchronize`); a block a server still has open stays allocated in torch's CUDA IPC limbo
        until the server drops its reference, and `ipc_collect` then frees it (see the module
        docstring)."""
        if not copies:
            return
        if self.on_gpu:
            torch.cuda.synchronize()
        copies.clear()
        if self.on_gpu:
            torch.cuda.ipc_collect()
