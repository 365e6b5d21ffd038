"""`AdapterSync`: adapter-only weight sync of a LoRA actor (`actor_rollout_ref.model.lora.sync=adapter`).

The servers start from the base model and never get base weights again; each push sends only
the adapters, as SGLang 0.5.23 serves them (`rollout.cpu.lora_adapters` has the protocol):

1. every actor rank: each adapter's TP shards are all-gathered over its TP group (B of a
   column-parallel base is split along dim 0, A of a row-parallel base along dim 1:
   `bridge.lora.AdapterName.tp`); the pipeline stages' adapters go to pipeline rank 0
   (`gather_object`, CPU tensors). Only global rank 0 (TP, PP and DP rank 0) uses them.
2. global rank 0 makes them a PEFT adapter (adapter_config.json as a dict, tensors by PEFT name)
   and, on every server at once, loads it as `<prefix>-v<version>`,
   `/unload_lora_adapter` of the earlier versions it reports holding, `/update_weight_version`.
   Loading before unloading leaves every server with a valid adapter if the load fails. How it
   loads (`actor_rollout_ref.model.lora.sync_via`):
   - "tensors" (default): `/load_lora_adapter_from_tensors` with the tensors in the request
     (`from_tensors_request`): no filesystem shared with the servers.
   - "disk": the adapter written to `<dir>/v<version>-<random>` (`bridge.lora.write_peft_adapter`),
     then `/load_lora_adapter` of that directory: every server must read `<dir>`. Earlier
     directories are deleted once no server holds them.
3. the outcome is broadcast: every rank returns the same metrics or raises `WeightSyncError`.

Rollout requests name `adapter_name(prefix, version)` (SGLang's `lora_path` field) to generate with the policy.
Like `WeightSync`, the servers must be idle and the parameters current when `push` starts, and
the sync moves no server memory: colocated, the caller resumes the servers' weights first (SGLang
restores the base from its CPU backup, `--enable-weights-cpu-backup`) and their KV cache after.
"""
from __future__ import annotations

import base64
import logging
import pickle
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.bridge.lora import AdapterName, peft_adapter, write_peft_adapter
from megarl.rollout.control import ServerError, on_all
from megarl.sync.servers import SyncServer

log = logging.getLogger("megarl.sync")
PREFIX = "megarl-actor"  # the servers' adapter names: <PREFIX>-v<version>
SYNC_VIA = ("tensors", "disk")  # actor_rollout_ref.model.lora.sync_via


def adapter_name(prefix: str, version: int) -> str:
    """The servers' name of the adapter pushed as `version`."""
    return f"{prefix}-v{version}"


def served_adapter(config, version: int) -> Optional[str]:
    """The adapter rollout requests name after a push of `version` (None: no adapter-only sync,
    requests use the servers' weights as they are)."""
    lora = config.actor_rollout_ref.model.lora
    return adapter_name(PREFIX, version) if lora.rank > 0 and lora.sync == "adapter" else None


def gather_full_adapters(attached: Sequence[tuple[Any, torch.nn.Module]], tp_group, pp_group) -> Optional[dict]:
    """{global megatron adapter name: full float32 CPU tensor} on pipeline rank 0, None elsewhere.
    Every rank of the TP and PP groups must call it. `attached`: the engine's (LoraAdapter, base) pairs."""
    local = {}
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    for adapter, _ in attached:
        for target in adapter.targets:
            for factor in "AB":
                param = getattr(adapter, f"{target}_{factor}").detach()
                dim = adapter.splits[f"{target}_{factor}"].dim
                if dim is not None and tp_size > 1:
                    shards = [torch.empty_like(param) for _ in range(tp_size)]
                    dist.all_gather(shards, param.contiguous(), group=tp_group)
                    param = torch.cat(shards, dim=dim)
                local[AdapterName(adapter.layer, target, factor).mcore] = param.float().cpu()
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return local
    stages = [None] * dist.get_world_size(pp_group) if dist.get_rank(pp_group) == 0 else None
    dist.gather_object(local, stages, dst=dist.get_global_rank(pp_group, 0), group=pp_group)
    return None if stages is None else {k: v for stage in stages for k, v in stage.items()}


def serialize_by_value(tensors: dict[str, torch.Tensor]) -> str:
    """One `serialized_named_tensors` entry holding the tensors' bytes themselves (base64 of a plain
    pickle: each storage as `torch.storage._load_from_bytes(bytes)`), readable on any host.
    SGLang 0.5.23's own `MultiprocessingSerializer.serialize` (utils/common.py) uses a
    ForkingPickler, which puts CPU tensors in shared memory (same host only) and CUDA tensors in
    IPC handles (same node only); its `SafeUnpickler` (utils/common.py, `find_class`) admits this
    by-value form: `torch._utils._rebuild_tensor_v2`, `collections.OrderedDict`, and
    `torch.storage._load_from_bytes`, which it maps to `torch.load(weights_only=True)`."""
    return base64.b64encode(pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def from_tensors_request(lora_name: str, config_dict: dict, payload: str, tp_size: int) -> dict:
    """The body of SGLang 0.5.23's `/load_lora_adapter_from_tensors` (entrypoints/http_server.py
    ~1663; `LoadLoRAAdapterFromTensorsReqInput`, managers/io_struct.py ~2548): `lora_name`,
    `config_dict` (adapter_config.json), `serialized_named_tensors` (one entry per TP rank of the
    server: TP rank r deserializes entry r, managers/tp_worker.py `deserialize_own_rank`),
    `load_format` null (the entry is the pickled {PEFT name: tensor} dict, tp_worker.py
    `load_lora_adapter_from_tensors`), `pinned` false. Left at their defaults: `added_tokens_config`,
    `lora_id` (the server makes one), `expected_checksums`."""
    return {"lora_name": lora_name, "config_dict": config_dict, "serialized_named_tensors": [payload] * tp_size,
            "load_format": None, "pinned": False}


class AdapterSync:
    """Same interface as `WeightSync` (`push`, `version`, `close`) for a LoRA actor."""

    def __init__(self, attached, rank: int, alpha: float, base_model: str, server_urls: Sequence[str],
                 out_dir: Optional[str] = None, *, via: str = "tensors",
                 api_key: Optional[str] = None, initial_version: int = 0, timeout_s: float = 600.0,
                 prefix: str = PREFIX, tp_group=None, pp_group=None):
        """`attached`: the engine's (LoraAdapter, base) pairs; `rank`, `alpha`: the adapters'
        (`actor_rollout_ref.model.lora`); `via`: "tensors" (in the request) or "disk";
        `out_dir`: with "disk", where the PEFT directories are written, readable by every server;
        `timeout_s`: seconds, each server call; `tp_group`/`pp_group`: megatron's (default: from
        `parallel_state`)."""
        if not server_urls:
            raise ValueError("adapter sync: no rollout servers")
        if via not in SYNC_VIA:
            raise ValueError(f"adapter sync: via={via!r} is not one of {list(SYNC_VIA)}")
        if via == "disk" and not out_dir:
            raise ValueError("adapter sync: via='disk' needs out_dir, a directory every server reads")
        if tp_group is None and pp_group is None:
            from megatron.core import parallel_state as ps

            tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        self.attached, self.rank, self.alpha, self.base_model = attached, rank, alpha, base_model
        self.tp_group, self.pp_group = tp_group, pp_group
        self.servers = [SyncServer(url, api_key, timeout_s=timeout_s) for url in server_urls]
        self.via, self.prefix = via, prefix
        self.out_dir = Path(out_dir) if via == "disk" else None
        self.version = initial_version

    def push(self, version: Optional[int] = None, flush: Optional[Sequence[bool]] = None) -> dict[str, float]:
        """Every actor rank calls it; returns the same metrics on every rank or raises `WeightSyncError`.
        `flush` (`WeightSync.push`'s) is not used: loading an adapter leaves the KV cache alone."""
        from megarl.sync.weight_sync import WeightSyncError

        started = time.perf_counter()
        target = self.version + 1 if version is None else version
        adapters = gather_full_adapters(self.attached, self.tp_group, self.pp_group)
        gathered = time.perf_counter()
        outcome = [None]
        if dist.get_rank() == 0:
            outcome = [self._send(adapters, target)]
        dist.broadcast_object_list(outcome, src=0)
        error, metrics = outcome[0]
        if error:
            raise WeightSyncError(f"adapter sync to version {target} failed: {error}")
        self.version = target
        return {**metrics, "sync/seconds": time.perf_counter() - started, "sync/gather_s": gathered - started}

    def _send(self, adapters: dict[str, torch.Tensor], version: int) -> tuple[Optional[str], dict]:
        name = adapter_name(self.prefix, version)
        sent = time.perf_counter()
        directory = None
        try:
            config, tensors = peft_adapter(adapters, self.rank, self.alpha, self.base_model)
            if self.via == "disk":
                directory = self.out_dir / f"v{version}-{uuid.uuid4().hex[:8]}"  # new even when a version is re-pushed
                write_peft_adapter(adapters, directory, self.rank, self.alpha, self.base_model)
            else:
                payload = serialize_by_value(tensors)

            def load(server: SyncServer) -> None:
                _unload_if_loaded(server, name)  # the same version pushed again (a restarted server, a re-push)
                if directory is None:
                    tp_size = int(server.server_info().get("tp_size", 1))
                    reply = server.load_lora_adapter_from_tensors(from_tensors_request(name, config, payload, tp_size))
                else:
                    reply = _load_from_disk(server, name, directory)
                for old in reply.get("loaded_adapters") or {}:  # earlier versions (a sync made after a restart
                    if old != name and old.startswith(f"{self.prefix}-v"):  # does not know them)
                        _unload_if_loaded(server, old)
                server.update_weight_version(str(version))

            on_all(self.servers, load)
        except (ServerError, OSError, ValueError) as e:
            return str(e), {}
        if directory is not None:
            for old in self.out_dir.glob("v*"):  # no server holds them any more
                if old != directory:
                    shutil.rmtree(old, ignore_errors=True)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        log.info("adapter sync to version %d: %d tensors, %.3f MB as %s via %s", version, len(tensors), nbytes / 1e6,
                 name, self.via)
        return None, {"sync/bytes": float(nbytes), "sync/adapter_tensors": float(len(tensors)),
                      "sync/send_s": time.perf_counter() - sent}

    def close(self) -> None:
        """Nothing to drop (no weight-update groups)."""


def _load_from_disk(server: SyncServer, name: str, directory: Path) -> dict:
    """`/load_lora_adapter` of `directory`; a server that cannot read it fails naming the keys."""
    try:
        return server.load_lora_adapter(name, str(directory))
    except ServerError as e:
        raise ServerError(f"{e} (actor_rollout_ref.model.lora.sync_via=disk: every rollout server must read "
                          f"{directory.parent}, under trainer.default_local_dir; without a filesystem shared by "
                          "all nodes use sync_via=tensors)") from e


def _unload_if_loaded(server: SyncServer, name: str) -> None:
    """Unload `name`; a server that does not hold it (restarted since) is fine."""
    try:
        server.unload_lora_adapter(name)
    except ServerError as e:
        if "does not exist" not in str(e):
            raise
