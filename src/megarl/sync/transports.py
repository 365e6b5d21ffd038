"""How HF buckets reach the rollout servers. One interface, three transports.

Each pipeline stage's emitter owns one transport object and streams its own buckets through it;
the coordinator (stage 0's emitter) keeps its last bucket back and hands it to `commit`, which is
the only call that sets the servers' weight version. A transport method that fails raises
`ServerError` naming the server(s).

    open_stream(push_id)       emitter, before its first bucket of a push (push_id: unique per attempt)
    send(bucket)               emitter, every bucket but the coordinator's last
    finish_stream() -> result  emitter, after its last bucket; the result goes to commit
    commit(bucket, results, version)   coordinator, once every stage succeeded
    reset()                    after a failed push: the next push starts from scratch

- `DistributedTransport`: `/init_weights_update_group` once (a group per stage: this emitter is
  rank 0, server i's TP ranks follow), then per bucket `/update_weights_from_distributed`
  (`flattened_bucket`) on every server *concurrently with* one `broadcast` of the bucket's bytes
  (the servers block in their receive until it comes). NCCL on GPU, gloo on CPU.
- `TensorTransport` (colocated): per bucket `/update_weights_from_tensor`; on GPU SGLang's
  `flattened_bucket` as CUDA IPC handles (SGLang needed), on CPU (name, tensor) pairs in shared
  memory. Each bucket's copy lives until the stream ends.
- `DiskTransport` (fallback, debugging): each stage writes its buckets as safetensors files into
  one directory; the commit writes the index and the HF config and calls `/update_weights_from_disk`.
"""
from __future__ import annotations

import gc
import json
import shutil
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megarl.bridge.convert import copy_hf_assets
from megarl.bridge.safetensors_io import INDEX_FILE, save_safetensors
from megarl.net import free_port
from megarl.rollout import tensor_payload
from megarl.rollout.control import ServerError
from megarl.rollout.weight_group import destroy_process_group, init_custom_process_group, unflatten_tensors
from megarl.sync.colocation import ColocationError, planner_colocated_peers
from megarl.sync.resharder import HFBucket
from megarl.sync.servers import SyncServer, on_all, wait_all


class Transport(Protocol):
    uses_session: bool  # the push runs inside the servers' begin/end_weight_update

    def open_stream(self, push_id: str) -> None: ...

    def send(self, bucket: HFBucket) -> None: ...

    def finish_stream(self) -> Any: ...

    def commit(self, bucket: HFBucket, stage_results: list[Any], weight_version: str) -> None: ...

    def reset(self) -> None: ...


def route_address(url: str) -> str:
    """This host's address on the route to `url`'s host (where a server can reach us)."""
    parsed = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parsed.hostname, parsed.port or 80))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def server_tp_sizes(servers: Sequence[SyncServer]) -> list[int]:
    """Each server's TP size (its ranks in a weight-update group), from `/server_info`."""
    return [int(info.get("tp_size", 1)) for info in on_all(servers, lambda s: s.server_info())]


class DistributedTransport:
    uses_session = True

    def __init__(self, servers: Sequence[SyncServer], stage: int, backend: str, master_address: Optional[str],
                 timeout_s: float):
        self.servers, self.stage, self.backend = list(servers), stage, backend
        self.master_address, self.timeout_s = master_address, timeout_s
        self.group = None
        self.group_name: Optional[str] = None
        self._pool = ThreadPoolExecutor(max(1, len(self.servers)), thread_name_prefix=f"weight-sync-pp{stage}")

    def open_stream(self, push_id: str) -> None:
        """Form this stage's weight-update group with every server, unless it exists."""
        if self.group is not None:
            return
        sizes = server_tp_sizes(self.servers)
        world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        address = self.master_address or route_address(self.servers[0].url)
        port = free_port(address)
        name = f"megarl-sync-pp{self.stage}-{uuid.uuid4().hex[:8]}"
        joins = {
            self._pool.submit(s.init_weights_update_group, address, port, offset, world_size, name, self.backend): s
            for s, offset in zip(self.servers, offsets)
        }
        try:
            group = init_custom_process_group(self.backend, address, port, 0, world_size, name, self.timeout_s)
        except Exception as e:
            wait_all(joins)  # a server's own error names it
            raise ServerError(f"pipeline stage {self.stage}: forming weight-update group {name} failed: {e}") from e
        wait_all(joins)
        self.group, self.group_name = group, name

    def send(self, bucket: HFBucket, weight_version: Optional[str] = None, flush_cache: bool = False) -> None:
        fields = bucket.request_fields()
        calls = {
            self._pool.submit(
                s.update_weights_from_distributed, fields["names"], fields["dtypes"], fields["shapes"],
                self.group_name, "flattened_bucket", weight_version, flush_cache,
            ): s
            for s in self.servers
        }
        failure = None
        try:
            dist.broadcast(bucket.flat, src=0, group=self.group)
        except Exception as e:  # a server died: gloo stops at the first dead peer, later ones never get the bucket
            failure = f"{type(e).__name__}: {e}"
        if failure is not None:  # outside the except block, so that no traceback frame holds the group
            self._drop_local_group()  # our connections close: servers blocked in a receive fail now, not at timeout
            try:
                wait_all(calls)
            except ServerError as server_error:
                raise ServerError(f"{server_error} (the broadcast failed too: {failure})") from None
            raise ServerError(f"pipeline stage {self.stage}: broadcast on group {self.group_name} failed: {failure}")
        wait_all(calls)

    def finish_stream(self) -> None:
        return None

    def commit(self, bucket: HFBucket, stage_results: list[Any], weight_version: str) -> None:
        self.send(bucket, weight_version=weight_version, flush_cache=True)

    def _drop_local_group(self) -> None:
        """Destroy this end of the group and release it: its connections close once nothing holds it."""
        group, self.group = self.group, None
        if group is None:
            return
        try:
            destroy_process_group(group)
        except Exception:  # a group broken by a dead peer may refuse a clean shutdown; it is dropped either way
            pass
        del group
        gc.collect()  # reference cycles may still hold it (and its sockets)

    def reset(self) -> None:
        """Drop the group here and on every server that still has it (errors ignored: a server
        that restarted has none)."""
        if self.group_name is None:
            return
        name, self.group_name = self.group_name, None
        self._drop_local_group()
        for future in [self._pool.submit(s.destroy_weights_update_group, name) for s in self.servers]:
            try:
                future.result()
            except ServerError:
                pass


class TensorTransport:
    """Colocated servers read each bucket from this process's memory (`/update_weights_from_tensor`).

    Every bucket is copied into fresh memory (the resharder reuses its buffer for the next bucket)
    and that copy is kept until the stream is over: SGLang answers once its copies are enqueued,
    not done, so a buffer is never overwritten or handed back while the server may still read it.

    - GPU (CUDA IPC; needs SGLang: `pip install -e '.[gpu]'`): SGLang's `flattened_bucket` with
      its `FlattenedTensorMetadata`, serialised after `monkey_patch_torch_reductions()` (GPUs named
      by UUID). Entry r of the request must be a handle to a copy on server TP rank r's own GPU
      (`sync.colocation`). This emitter serialises its own copy only, so every server TP rank must
      sit on this emitter's GPU (one TP-1 server, an actor of one rank); other layouts raise (the
      relay that gives each colocated actor rank its own copy to serialise is not built yet).
      `finish_stream` synchronises the device before the copies are dropped, then
      `torch.cuda.ipc_collect()` frees the blocks the servers have released. (torch's IPC refcount
      keeps a block whose consumer still holds it; the consumer syncs its stream before releasing:
      torch/csrc/StorageSharing.cpp.)
    - CPU: `load_format` null, (name, tensor) views into a shared-memory copy of the bucket
      (`rollout.tensor_payload`, no SGLang needed); every TP rank may read the same copy, so the
      servers only need to be on this host. The copy's file is released when the stream ends.
    """

    uses_session = True

    def __init__(self, servers: Sequence[SyncServer], rank: int = 0, world_size: int = 1):
        """`rank`, `world_size`: this emitter's rank in the actor's world and its size (on GPU,
        the planner's colocated layout says which actor rank sits on each server GPU)."""
        self.servers, self.rank, self.world_size = list(servers), rank, world_size
        self.on_gpu = torch.cuda.is_available()
        self._tp_sizes: Optional[dict[str, int]] = None
        self._held: list[torch.Tensor] = []  # this stream's bucket copies, alive until finish_stream

    @property
    def in_flight(self) -> tuple[torch.Tensor, ...]:
        """The bucket copies the servers may still read (every bucket sent in this stream)."""
        return tuple(self._held)

    def open_stream(self, push_id: str) -> None:
        self._release()
        if self._tp_sizes is not None:
            return
        sizes = server_tp_sizes(self.servers)
        if self.on_gpu:
            _sglang_serialisation()  # fail here, before any bucket, if SGLang is missing
            peers = planner_colocated_peers(sizes, self.world_size)
            elsewhere = [f"{s.url} TP rank {r} (actor rank {k}'s GPU)" for s, row in zip(self.servers, peers)
                         for r, k in enumerate(row) if k != self.rank]
            if elsewhere:
                raise ColocationError(
                    f"the tensor transport sends a handle to this emitter's (actor rank {self.rank}) GPU copy, and "
                    f"a CUDA IPC handle opens only on its own GPU; these server ranks sit on other GPUs: "
                    f"{', '.join(elsewhere)}. Giving each colocated actor rank its own copy to serialise is not "
                    "implemented yet: use one actor rank and one TP-1 server, or the 'disk' transport"
                )
        self._tp_sizes = dict(zip([s.url for s in self.servers], sizes))

    def send(self, bucket: HFBucket, weight_version: Optional[str] = None, flush_cache: bool = False) -> None:
        if self.on_gpu:
            if not bucket.flat.is_cuda:
                raise RuntimeError(f"bucket {bucket.index} is on {bucket.flat.device}: onload the actor before a push")
            serializer, metadata_class = _sglang_serialisation()
            copy = bucket.flat.clone()  # fresh memory: the resharder overwrites bucket.flat next
            metadata = [metadata_class(name=s.name, shape=torch.Size(s.shape), dtype=s.dtype, start_idx=s.start,
                                       end_idx=s.end, numel=s.end - s.start) for s in bucket.slots]
            payload = serializer.serialize({"flattened_tensor": copy, "metadata": metadata}, output_str=True)
            load_format = "flattened_bucket"
        else:
            copy = tensor_payload.shared_cpu_copy(bucket.flat)
            payload = tensor_payload.serialize(unflatten_tensors(copy, list(bucket.slots)))
            load_format = None
        self._held.append(copy)  # before the call: a server may read it even if the call then fails
        on_all(self.servers, lambda s: s.update_weights_from_tensor(
            [payload] * self._tp_sizes[s.url], load_format, weight_version, flush_cache))

    def finish_stream(self) -> None:
        self._release()

    def commit(self, bucket: HFBucket, stage_results: list[Any], weight_version: str) -> None:
        try:
            self.send(bucket, weight_version=weight_version, flush_cache=True)
        finally:
            self._release()

    def _release(self) -> None:
        """Drop this stream's copies: every server has answered (or failed) for each of them."""
        if not self._held:
            return
        if self.on_gpu:
            torch.cuda.synchronize()  # this process's work on the copies is done
        self._held.clear()
        if self.on_gpu:
            torch.cuda.ipc_collect()

    def reset(self) -> None:
        self._release()
        self._tp_sizes = None


def _sglang_serialisation():
    """(SGLang's `MultiprocessingSerializer`, its `FlattenedTensorMetadata`), with torch's CUDA
    reductions patched to name GPUs by UUID (the server's CUDA_VISIBLE_DEVICES may differ)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError as e:
        raise RuntimeError(
            "the tensor transport on GPU serialises CUDA IPC handles with SGLang's own classes (its server "
            f"accepts no others); install the GPU extras: pip install -e '.[gpu]' ({type(e).__name__}: {e})"
        ) from e
    monkey_patch_torch_reductions()
    return MultiprocessingSerializer, FlattenedTensorMetadata


class DiskTransport:
    """An HF checkpoint under `directory/push-<push id>/`: one safetensors file per bucket
    (`pp{stage}-{index}.safetensors`), `model.safetensors.index.json` and the config and tokenizer
    files of `hf_assets_dir`. `directory` must be visible to the servers. Earlier pushes'
    directories are removed after a successful commit."""

    uses_session = False

    def __init__(self, servers: Sequence[SyncServer], stage: int, directory: str | Path, hf_assets_dir: str | Path,
                 expected_names: Sequence[str]):
        self.servers, self.stage = list(servers), stage
        self.directory, self.hf_assets_dir = Path(directory), Path(hf_assets_dir)
        self.expected_names = list(expected_names)
        self.push_dir: Optional[Path] = None
        self.weight_map: dict[str, str] = {}
        self.bytes = 0

    def open_stream(self, push_id: str) -> None:
        self.push_dir = self.directory / f"push-{push_id}"
        self.push_dir.mkdir(parents=True, exist_ok=True)
        self.weight_map, self.bytes = {}, 0

    def send(self, bucket: HFBucket) -> None:
        file = f"pp{self.stage:03d}-{bucket.index:05d}.safetensors"
        tensors = {name: t.to("cpu", copy=True) for name, t in bucket.named_tensors()}  # own storage each
        save_safetensors(tensors, self.push_dir / file)
        self.weight_map.update({name: file for name in tensors})
        self.bytes += bucket.nbytes

    def finish_stream(self) -> dict:
        return {"weight_map": dict(self.weight_map), "bytes": self.bytes}

    def commit(self, bucket: HFBucket, stage_results: list[Any], weight_version: str) -> None:
        self.send(bucket)
        weight_map, total = dict(self.weight_map), 0
        for result in stage_results:
            for name, file in result["weight_map"].items():
                if weight_map.setdefault(name, file) != file:
                    raise RuntimeError(f"{self.push_dir}: tensor {name} was written by two stages")
            total += result["bytes"]
        total += bucket.nbytes
        if set(weight_map) != set(self.expected_names):
            raise RuntimeError(
                f"{self.push_dir}: the stages wrote {len(weight_map)} tensors, the model has "
                f"{len(self.expected_names)}; differences: {sorted(set(weight_map) ^ set(self.expected_names))[:5]}"
            )
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.push_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        copy_hf_assets(self.hf_assets_dir, self.push_dir)
        on_all(self.servers, lambda s: s.update_weights_from_disk(str(self.push_dir), weight_version=weight_version))
        for old in self.directory.glob("push-*"):
            if old != self.push_dir:
                shutil.rmtree(old, ignore_errors=True)

    def reset(self) -> None:
        self.weight_map, self.bytes = {}, 0
