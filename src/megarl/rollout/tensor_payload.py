"""The payloads of `/update_weights_from_tensor`, both ends, as SGLang 0.5.23 defines them.

Request (sglang `managers/io_struct.py::UpdateWeightsFromTensorReqInput`, served by
`entrypoints/http_server.py`): `serialized_named_tensors` is a list of base64 strings, one per TP
rank of the server (TP rank r reads entry r: `managers/tp_worker.py::deserialize_own_rank`), each
a `ForkingPickler` pickle (sglang `utils/common.py::MultiprocessingSerializer`). What it holds
depends on `load_format` (`model_executor/model_runner_components/weight_updater.py`):

- null (or "direct"): a list of (HF name, tensor) pairs; SGLang moves each tensor to its device
  (`tensor.to(device)`), so CPU tensors are accepted. This is what megarl sends without SGLang
  installed: the tensors are views into one buffer in shared memory.
- "flattened_bucket": {"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata]};
  the metadata objects are SGLang's own class (its unpickler allows only that module path), so
  only a trainer with SGLang installed can produce it.

CPU tensors travel as shared-memory file names (`file_system` sharing strategy): the default
`file_descriptor` strategy passes descriptors through a resource sharer that authenticates with
the sender's multiprocessing key, which an unrelated server process does not have
(`reference/sglang-protocol.md` §1.4). A shared file lives while a process holds it: the sender
keeps its copy until the server acknowledged the request, the server drops its view after loading.
The first such share starts torch's `torch_shm_manager` helper, which would keep this process's
standard streams open as long as any server lives: `file_system_sharing` starts it without them.

The receiving side unpickles with an allow-list (tensor and storage rebuild functions, dtypes,
plain containers; SGLang's metadata classes only if SGLang is installed), never a plain
`pickle.loads` of what a client sent.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import sys
import threading
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp

LOAD_FORMATS = (None, "direct", "flattened_bucket")
_STRATEGY_LOCK = threading.Lock()
_FDS_CLOSED_ON_EXEC = False
_SHM_MANAGER_STARTED = False


def _keep_fds_from_shm_manager() -> None:
    """Mark this process's descriptors above stderr close-on-exec, once, before its first share.

    The first file-name share starts torch's `torch_shm_manager` daemon by fork + exec; it inherits
    every inheritable descriptor and lives while any process that opened a shared file (the
    rollout servers) stays connected. A parent waiting for one of our descriptors to close (a
    multiprocessing sentinel, a pipe) would otherwise wait for the servers to exit."""
    global _FDS_CLOSED_ON_EXEC
    if _FDS_CLOSED_ON_EXEC or not os.path.isdir("/proc/self/fd"):
        return
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # the listing's own descriptor, closed by now
                pass
    _FDS_CLOSED_ON_EXEC = True


def _start_shm_manager_without_our_streams() -> None:
    """Start torch's `torch_shm_manager` now, once, with /dev/null as its stdin, stdout and stderr.
    Call with the `file_system` strategy set and `_STRATEGY_LOCK` held.

    torch starts the helper on this process's first share by file name (`THManagedMapAllocator`,
    torch/lib/libshm/core.cpp::start_manager): fork + exec, replacing only its stdout (by the pipe
    it reports its socket through), so it inherits our stdin and stderr. It lives until the last
    process connected to it has gone (libshm/manager.cpp: it exits 2 s after its last client):
    this one, and every rollout server that opened one of our shared files (they run in sessions
    of their own). A caller reading our stderr through a pipe (`megarl train ... 2>&1 | tee log`,
    subprocess.run(capture_output=True)) would get EOF only once the servers are gone, not when we
    exit. There is no option to start it otherwise, so its first share happens here, a one-element
    tensor, with fds 0, 1 and 2 pointing at /dev/null, then restored; libshm keeps the connection
    (core.cpp `managers`), so every later share of this process uses that helper and forks nothing.
    Output other threads write to fds 1 and 2 during those few milliseconds is lost."""
    global _SHM_MANAGER_STARTED
    if _SHM_MANAGER_STARTED or os.name != "posix":
        return
    for stream in (sys.stdout, sys.stderr):  # what Python buffered goes out to the real streams first
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, closed or detached
            pass
    devnull = os.open(os.devnull, os.O_RDWR)
    saved = {}
    try:
        for fd in (0, 1, 2):
            try:
                saved[fd] = os.dup(fd)  # not inheritable (PEP 446): the helper gets none of these copies
            except OSError:  # closed in this process: closed again afterwards
                saved[fd] = None
            os.dup2(devnull, fd)
        torch.empty(1).share_memory_()  # file_system: the helper starts here (none running yet)
    finally:
        for fd, copy in saved.items():
            if copy is None:
                os.close(fd)
            else:
                os.dup2(copy, fd)
                os.close(copy)
        os.close(devnull)
    _SHM_MANAGER_STARTED = True


@contextmanager
def file_system_sharing():
    """Share CPU storage by file name within the block (torch reads the strategy when it shares).
    The first call starts torch's shared-memory helper without this process's descriptors."""
    with _STRATEGY_LOCK:
        _keep_fds_from_shm_manager()
        previous = torch_mp.get_sharing_strategy()
        torch_mp.set_sharing_strategy("file_system")
        try:
            _start_shm_manager_without_our_streams()
            yield
        finally:
            torch_mp.set_sharing_strategy(previous)


def shared_cpu_copy(flat: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor `flat` in its own shared-memory file."""
    with file_system_sharing():
        copy = torch.empty_like(flat, device="cpu").share_memory_()
    copy.copy_(flat)
    return copy


def serialize(obj: Any) -> str:
    """SGLang's serialisation: a `ForkingPickler` pickle, base64 (CPU storage shared by file name)."""
    buffer = io.BytesIO()
    with file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


_ALLOWED = {
    ("builtins", name) for name in ("list", "tuple", "dict", "str", "int", "float", "bool", "bytes", "bytearray")
} | {("collections", "OrderedDict"), ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"),
     ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage")} | {
    ("torch.multiprocessing.reductions", name) for name in (
        "rebuild_tensor", "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage",
        "rebuild_typed_storage_child", "rebuild_cuda_tensor")
} | {("torch._utils", name) for name in ("_rebuild_tensor", "_rebuild_tensor_v2")}
# only importable with SGLang installed (its CUDA rebuild names GPUs by UUID; its bucket metadata)
_ALLOWED_SGLANG = {
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED | _ALLOWED_SGLANG or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a weight payload")


def deserialize(payload: Any) -> Any:
    """The object of one entry of `serialized_named_tensors`; raises ValueError if it is not a
    valid payload (bad base64, a forbidden global, shared memory that is gone)."""
    if not isinstance(payload, str):
        raise ValueError(f"a serialized_named_tensors entry must be a base64 string, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"a serialized_named_tensors entry is not valid base64: {e}") from None
    try:
        if b"sglang.srt.utils.patch_torch" in raw:  # CUDA handles naming GPUs by UUID: SGLang's patched rebuild,
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions  # which needs its patch applied

            monkey_patch_torch_reductions()
        return _RestrictedUnpickler(io.BytesIO(raw)).load()
    except Exception as e:  # unpickling runs torch's rebuild functions: any failure is the payload's
        raise ValueError(f"a serialized_named_tensors entry could not be unpickled: {type(e).__name__}: {e}") from None


def check_load_format(load_format: str | None) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is not supported; use null, 'direct' or 'flattened_bucket'")


def named_tensors(obj: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a deserialised payload in `load_format`; ValueError if malformed."""
    check_load_format(load_format)
    if load_format == "flattened_bucket":
        if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
            raise ValueError("a flattened_bucket payload must be {'flattened_tensor': ..., 'metadata': [...]}")
        flat = obj["flattened_tensor"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
        out = []
        for meta in obj["metadata"]:  # SGLang's FlattenedTensorMetadata: byte offsets into the uint8 tensor
            dtype, start, end = meta.dtype, meta.start_idx, meta.end_idx
            if not 0 <= start <= end <= flat.numel():
                raise ValueError(f"tensor {meta.name}: bytes [{start}, {end}) outside the bucket of {flat.numel()}")
            out.append((meta.name, flat[start:end].view(dtype).reshape(meta.shape)))
        return out
    if not isinstance(obj, (list, tuple)) or not all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
        for p in obj
    ):
        raise ValueError("a payload with load_format null must be a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in obj]
