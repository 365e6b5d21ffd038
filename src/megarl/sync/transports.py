"""How HF buckets reach the rollout servers. One interface, three transports.

Each emitter (`groups.py`: a stage's, an EP rank's experts') owns one transport object and streams
its own buckets through it; the coordinator (stage 0's emitter) keeps its last bucket back and
hands it to `commit`, which is the only call that sets the servers' weight version. A transport method that fails raises
`ServerError` naming the server(s).

    open_stream(push_id)       emitter, before its first bucket of a push (push_id: unique per attempt)
    send(bucket)               emitter, every bucket but the coordinator's last
    finish_stream() -> result  emitter, after its last bucket; the result goes to commit
    commit(bucket, results, version)   coordinator, once every emitter succeeded
    reset()                    after a failed push: the next push starts from scratch

- `DistributedTransport`: `/init_weights_update_group` once (a group per emitter: it is
  rank 0, server i's TP ranks follow; by default one emitter per pipeline stage and EP rank's
  experts, `SyncConfig.weight_update_groups`), then per bucket `/update_weights_from_distributed`
  (`flattened_bucket`) on every server *concurrently with* one `broadcast` of the bucket's bytes
  (the servers block in their receive until it comes). NCCL on GPU, gloo on CPU.
- `TensorTransport` (colocated): per bucket `/update_weights_from_tensor`; on GPU SGLang's
  `flattened_bucket` as CUDA IPC handles (SGLang needed), entry r serialised by the actor rank on
  TP rank r's GPU (relayed bucket by bucket, interleaved with the stream, by `ipc_copies` with
  every actor rank); on CPU (name, tensor) pairs in shared memory. The resharder writes each
  bucket straight into memory a server may open (`Resharder.hf_memory`), sent without a copy and
  dropped once the servers answered its request (a failed one's at `reset`): an emitter holds one
  bucket at a time besides the resharder's gather rows; a relaying rank one received copy in
  flight, plus the commit bucket's until the commit.
- `DiskTransport` (fallback, debugging): each emitter writes its buckets as safetensors files into
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
from megarl.bridge.safetensors_io import INDEX_FILE, write_safetensors
from megarl.net import free_port
from megarl.rollout.control import ServerError, on_all, wait_all
from megarl.rollout.weight_group import destroy_process_group, init_custom_process_group
from megarl.sync.colocation import ColocationError, checked_peers, planner_colocated_peers
from megarl.sync.ipc_copies import Entries, Outgoing, fresh_copy, serialise_copy, sglang_serialisation
from megarl.sync.resharder import HFBucket
from megarl.sync.servers import SyncServer


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


# An expert-parallel SGLang server (`--ep-size`, actor_rollout_ref.rollout.expert_parallel_size) has no
# ranks beyond its TP ranks: SGLang 0.5.23 lays EP over them (runtime_context.derive_spawn_ranks), and each
# TP rank joins a weight-update group at rank_offset + tp_rank (weight_updater.init_weights_update_group).
# Every rank receives every HF tensor of a push whole, under its global expert name
# (`mlp.experts.<e>.gate_proj.weight`), and keeps its own experts as when it loads the checkpoint at start:
# update_weights_from_distributed / _from_tensor call the model's `load_weights` (models/qwen3_moe.py,
# qwen2_moe.py, mixtral.py), which maps an expert name through FusedMoE.make_expert_params_mapping to
# FusedMoE.weight_loader, where `_map_global_expert_id_to_local_expert_id` (layers/moe/fused_moe_triton/
# layer.py) gives -1, and the tensor is skipped, for an expert of another EP rank. So the push is the same
# at every server EP (tests/rollout/test_sglang_expert_parallel.py runs that code of the wheel on the names).
def server_tp_sizes(servers: Sequence[SyncServer]) -> list[int]:
    """Each server's TP size (its ranks in a weight-update group, EP ranks among them), from `/server_info`."""
    return [int(info.get("tp_size", 1)) for info in on_all(servers, lambda s: s.server_info())]


class DistributedTransport:
    uses_session = True

    def __init__(self, servers: Sequence[SyncServer], stage: int, backend: str, master_address: Optional[str],
                 group_timeout_s: float):
        """`group_timeout_s`: seconds, the bound of forming the weight-update group and of each of its
        collectives (the servers' calls have their own, `SyncServer`'s)."""
        self.servers, self.stage, self.backend = list(servers), stage, backend
        self.master_address, self.group_timeout_s = master_address, group_timeout_s
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
            group = init_custom_process_group(self.backend, address, port, 0, world_size, name, self.group_timeout_s)
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
    """Colocated servers read each bucket from the trainer's memory (`/update_weights_from_tensor`).

    Every bucket is sent from memory of its own: the resharder writes it into shareable memory
    (`WeightSync` gives it `ipc_copies.shareable_empty` as `hf_memory`: `HFBucket.owned`), else it is
    copied there (a reused resharder buffer is overwritten by the next bucket). That memory lives
    until the servers answered the request made from it; memory whose request failed (or timed
    out: the server may still read it) lives until `reset()`.

    - Per-TP-rank copies (always on GPU; on CPU when the planner's colocated layout holds, i.e. the
      servers' TP ranks are the actor's ranks one to one): entry r of a request must be serialised
      by the actor rank on server TP rank r's own GPU (`sync.colocation`). `send` only makes the
      copy; `outgoing` hands it, in the same round, to `ipc_copies.IpcRelay.round`, in which every
      actor rank takes part: it gives each colocated rank its own copy to serialise, posts the
      request (`_post`) and drops the copies once it was answered. On GPU that is SGLang's
      `flattened_bucket` of CUDA IPC handles (SGLang needed: `pip install -e '.[gpu]'`), serialised
      after `monkey_patch_torch_reductions()` (GPUs named by UUID). A GPU layout the planner would
      not make raises.
    - One shared copy (CPU, other layouts): `load_format` null, (name, tensor) views into a
      shared-memory copy of the bucket (`rollout.tensor_payload`, no SGLang needed), posted at each
      `send` and dropped when every server answered (the CPU engine answers once it copied the
      tensors into its model: `rollout/cpu/server.py::load_tensor_payload`); every TP rank may read
      the same copy, so the servers only need to be on this host.
    """

    uses_session = True

    def __init__(self, servers: Sequence[SyncServer], rank: int = 0, world_size: int = 1, on_gpu: bool = False,
                 peers: Optional[Sequence[Sequence[int]]] = None):
        """`rank`, `world_size`: this emitter's rank in the actor's world and its size; `on_gpu`: the
        copies are CUDA memory (`ipc_copies.copies_on_gpu`); `peers[s][r]`: the actor rank on server
        s's TP rank r's real GPU (the trainer maps them from the GPUs Ray gave,
        `placement.gpu_order`); None: the planner's colocated layout (`planner_colocated_peers`)."""
        self.servers, self.rank, self.world_size = list(servers), rank, world_size
        self.on_gpu = on_gpu
        self._given_peers = None if peers is None else [list(row) for row in peers]
        self._tp_sizes: Optional[dict[str, int]] = None
        self.peers: Optional[list[list[int]]] = None  # per-TP-rank copies: peers[s][r] serialises entry r of server s
        self._failed: list[torch.Tensor] = []  # one shared copy: copies of failed requests, alive until reset()
        self._pending: Optional[Outgoing] = None  # per-TP-rank copies: the bucket sent, until `outgoing` takes it
        self._commit_entries: Optional[Entries] = None

    @property
    def in_flight(self) -> tuple[torch.Tensor, ...]:
        """The bucket copies this transport holds that a server may read (the relay holds the others)."""
        return tuple(self._failed) + (() if self._pending is None else (self._pending.flat,))

    def open_stream(self, push_id: str) -> None:
        self._pending, self._commit_entries = None, None
        if self._tp_sizes is not None:
            return
        sizes = server_tp_sizes(self.servers)
        if self.on_gpu:
            sglang_serialisation()  # fail here, before any bucket, if SGLang is missing
        try:
            self.peers = (planner_colocated_peers(sizes, self.world_size) if self._given_peers is None
                          else checked_peers(self._given_peers, sizes, self.world_size))
        except ColocationError as e:
            if self.on_gpu:  # a CUDA IPC handle opens only on its own GPU: no other copy will do
                raise ColocationError(f"the tensor transport cannot give every server TP rank a copy on its own "
                                      f"GPU: {e}; use the 'disk' transport") from None
            self.peers = None  # CPU: one shared-memory copy serves every TP rank of this host
        self._tp_sizes = dict(zip([s.url for s in self.servers], sizes))

    def send(self, bucket: HFBucket, weight_version: Optional[str] = None, flush_cache: bool = False) -> None:
        if self.on_gpu and not bucket.flat.is_cuda:
            raise RuntimeError(f"bucket {bucket.index} is on {bucket.flat.device}: onload the actor before a push")
        copy = bucket.flat if bucket.owned else fresh_copy(bucket.flat)  # a reused buffer is overwritten next
        if self.peers is not None:
            if self._pending is not None:
                raise RuntimeError(f"bucket {bucket.index}: the previous bucket was not relayed (call outgoing())")
            self._pending = Outgoing(copy, bucket.slots, self.peers, self._post)
            return
        payload, load_format = serialise_copy(copy, bucket.slots)
        try:
            on_all(self.servers, lambda s: s.update_weights_from_tensor(
                [payload] * self._tp_sizes[s.url], load_format, weight_version, flush_cache))
        except Exception:
            self._failed.append(copy)  # a server may still read it
            raise

    def outgoing(self, commit_bucket: Optional[HFBucket] = None) -> Optional[Outgoing]:
        """Per-TP-rank copies: the bucket just sent, for this round of the relay, or (the
        coordinator's last bucket) `commit_bucket`, whose entries `commit` posts; None with one
        shared copy or nothing sent. The caller drops it after the round."""
        if self.peers is None:
            return None
        if commit_bucket is not None:
            flat = commit_bucket.flat if commit_bucket.owned else fresh_copy(commit_bucket.flat)
            return Outgoing(flat, commit_bucket.slots, self.peers, self._keep_for_commit,
                            commit=True)
        item, self._pending = self._pending, None
        return item

    def _post(self, entries: Entries, weight_version: Optional[str] = None, flush_cache: bool = False) -> None:
        """One request per server: entry r for its TP rank r."""
        load_format = "flattened_bucket" if self.on_gpu else None
        by_url = {s.url: row for s, row in zip(self.servers, entries)}
        on_all(self.servers, lambda s: s.update_weights_from_tensor(by_url[s.url], load_format, weight_version,
                                                                     flush_cache))

    def _keep_for_commit(self, entries: Entries) -> None:
        self._commit_entries = entries

    def finish_stream(self) -> None:
        return None

    def commit(self, bucket: HFBucket, stage_results: list[Any], weight_version: str) -> None:
        if self.peers is not None:
            if self._commit_entries is None:
                raise RuntimeError("commit: the last bucket was not relayed to the colocated ranks")
            entries, self._commit_entries = self._commit_entries, None
            self._post(entries, weight_version=weight_version, flush_cache=True)
            return
        self.send(bucket, weight_version=weight_version, flush_cache=True)

    def reset(self) -> None:
        """After a failed push: drop the copies of failed requests, forget the servers' layout."""
        self._failed.clear()
        self._pending, self._commit_entries = None, None
        self._tp_sizes = self.peers = None


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
        tensors = bucket.named_tensors()
        write_safetensors(tensors, self.push_dir / file)  # from the bucket's memory: no copy of it
        self.weight_map.update({name: file for name, _ in tensors})
        self.bytes += bucket.nbytes

    def finish_stream(self) -> dict:
        return {"weight_map": dict(self.weight_map), "bytes": self.bytes}

    def commit(self, bucket: HFBucket, stage_results: list[Any], weight_version: str) -> None:
        self.send(bucket)
        weight_map, total = dict(self.weight_map), 0
        for result in stage_results:
            for name, file in result["weight_map"].items():
                if weight_map.setdefault(name, file) != file:
                    raise RuntimeError(f"{self.push_dir}: tensor {name} was written by two emitters")
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
