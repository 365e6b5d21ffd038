"""CPU shims for megatron-core MoE layers (expert parallelism over gloo), beyond the dense ones.

`apply_moe_cpu_shims()` patches, only when CUDA is absent, the places where megatron-core 0.16.1's
MoE code assumes CUDA or NCCL; each shim names the line that needs it (measured in
../shared/reference/moe-on-cpu.md). Kept apart from `shims.py` (the dense shims) and applied after
them. One shim is needed on GPUs too: `te_general_gemm` (a megatron bug without transformer-engine).
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

_applied: set[str] = set()


class _NoOpEvent:
    def synchronize(self): pass
    def wait(self, *args, **kwargs): pass
    def record(self, *args, **kwargs): pass
    def query(self): return True


class _NoOpStream:
    """Stands in for a CUDA stream: work on the CPU is already in order."""

    def wait_stream(self, *args, **kwargs): pass
    def wait_event(self, *args, **kwargs): pass
    def record_event(self, *args, **kwargs): return _NoOpEvent()
    def synchronize(self): pass


_STREAM = _NoOpStream()


def _shim_streams() -> None:
    """`torch.cuda.Stream/current_stream/stream/Event` are no-op stand-ins.

    Needed by transformer/moe/token_dispatcher.py:445 `cuda_dtoh_stream = torch.cuda.Stream()` (the
    alltoall dispatcher, at model construction) and lines 871-895 (`current_stream`, `stream()`,
    `record_event`, every dispatch)."""
    torch.cuda.Stream = lambda *args, **kwargs: _STREAM
    torch.cuda.current_stream = lambda *args, **kwargs: _STREAM
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.Event = lambda *args, **kwargs: _NoOpEvent()


def _shim_te_general_gemm() -> None:
    """`moe_utils.te_general_gemm` is None when transformer-engine is absent.

    transformer/moe/moe_utils.py:1192/1225 test `te_general_gemm is not None`, but the name is
    bound only inside the transformer-engine import `try` (lines 22-39): a `NameError` at every
    router forward without transformer-engine, on GPUs too."""
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _shim_mla_te_check() -> None:
    """Multi-latent attention takes transformer-engine as absent when it is.

    transformer/multi_latent_attention.py:184 `HAVE_TE and isinstance(self.linear_proj, TELinear)`
    (every `MLASelfAttention` construction): its import of extensions/transformer_engine.py succeeds
    without transformer-engine (that module stands a `MagicMock` in for it, line 76), so `HAVE_TE` is
    True and `TELinear` a mock: `TypeError: isinstance() arg 2 must be a type`, on GPUs too."""
    import importlib.util

    import megatron.core.transformer.multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False


def _shim_split_sizes() -> None:
    """All-to-all split sizes on CPU become numpy arrays, as CUDA ones do.

    moe_utils.py:1093 `maybe_move_tensor_to_cpu` converts only CUDA tensors; CPU tensors then reach
    `all_to_all_single` (tensor_parallel/mappings.py:444) as tensors, which it refuses."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _shim_uneven_all_gather() -> None:
    """Uneven all-gathers are padded to the largest piece (gloo refuses uneven sizes).

    tensor_parallel/mappings.py:150 all-gathers uneven `output_split_sizes` when ETP > 1 and
    EP > 1 (token_dispatcher.py:696); gloo raises `invalid tensor size`."""
    import torch.distributed as dist
    import megatron.core.tensor_parallel.mappings as mappings

    original = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or len(set(output_split_sizes)) == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros([max(output_split_sizes), *input_.shape[1:]])
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in range(group.size())]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(pieces, output_split_sizes)], dim=0)

    mappings._gather_along_first_dim = _gather_along_first_dim


MOE_CPU_SHIMS: dict[str, Callable[[], None]] = {
    "streams": _shim_streams,
    "te_general_gemm": _shim_te_general_gemm,
    "split_sizes": _shim_split_sizes,
    "uneven_all_gather": _shim_uneven_all_gather,
    "mla_te_check": _shim_mla_te_check,
}
_ALWAYS = {"te_general_gemm", "mla_te_check"}  # megatron bugs wherever transformer-engine is absent


def apply_moe_cpu_shims() -> tuple[str, ...]:
    """Apply the MoE shims (CPU only, except `te_general_gemm`); idempotent. Returns those applied."""
    for name, shim in MOE_CPU_SHIMS.items():
        if name in _applied or (torch.cuda.is_available() and name not in _ALWAYS):
            continue
        shim()
        _applied.add(name)
    return tuple(n for n in MOE_CPU_SHIMS if n in _applied)
