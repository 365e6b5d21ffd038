"""Run real megatron-core on a CPU-only torch build, over gloo.

megatron-core assumes CUDA in a handful of places that have nothing to do with the maths it runs.
`apply_cpu_shims()` patches exactly those places, and only when CUDA is unavailable; with CUDA it
does nothing. Each shim names the megatron-core 0.16.1 line that needs it (0.19.2 where only that release needs
it: `SHIM_SINCE`), and
`tests/engines/test_cpu_shims.py` shows, for each one, a scenario that fails without it.

The shims touch megatron-core internals, so they are pinned: on a CPU-only machine,
`apply_cpu_shims()` refuses a megatron-core version they were not verified on
(`VERIFIED_MEGATRON_CORE_VERSIONS`).

The worker group applies them (`engines.megatron.parallel.init_role_parallel_state`); the tests'
gloo worlds apply them through `megarl.testing.init_gloo_model_parallel`. The MoE layers' shims are
`moe_shims.py`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import sys
import types
from typing import Any, Callable, Optional, Sequence

import torch

VERIFIED_MEGATRON_CORE_VERSIONS = ("0.16.1", "0.19.2")  # the tested lines (README "Tested versions")


class UnverifiedMegatronVersion(RuntimeError):
    """The CPU shims were not verified on the installed megatron-core version."""


def megatron_core_version() -> str:
    """The installed megatron-core release, e.g. "0.19.2", from its distribution metadata.

    Not `megatron.core.package_info.__version__`: since 0.19 it appends the short hash of any git
    checkout around the installed package ("0.19.2+31555cf" for a venv inside a repository)."""
    import importlib.metadata

    return importlib.metadata.version("megatron-core")


def check_shims_verified(version: str) -> None:
    """Raise `UnverifiedMegatronVersion` unless the CPU shims were verified on `version`."""
    if version not in VERIFIED_MEGATRON_CORE_VERSIONS:
        raise UnverifiedMegatronVersion(
            f"megatron-core {version} is installed, but megarl's CPU shims "
            f"(megarl.engines.megatron.cpu) were verified on {', '.join(VERIFIED_MEGATRON_CORE_VERSIONS)} only. "
            "They patch megatron-core internals, so on a machine without CUDA either install "
            f"megatron-core=={VERIFIED_MEGATRON_CORE_VERSIONS[-1]} or re-verify the shims on this version "
            "(tests/engines/test_cpu_shims.py) and add it to VERIFIED_MEGATRON_CORE_VERSIONS."
        )


def _caller_module(depth: int = 2) -> str:
    """Module name of the code `depth` frames up: 2 is the caller of the function calling this."""
    return sys._getframe(depth).f_globals.get("__name__", "")


# ------------------------------------------------------------------------------------------
# The shims. Line numbers are megatron-core 0.16.1.
# ------------------------------------------------------------------------------------------
def _shim_current_device() -> None:
    """`torch.cuda.current_device()` returns the CPU device.

    Needed by models/common/embeddings/rotary_pos_embedding.py:162
    `self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())` (every RoPE forward),
    distributed/param_and_grad_buffer.py:806 (megatron DDP's grad buffers), and the TP
    gather/scatter and p2p buffers allocated on `torch.cuda.current_device()`.
    """
    torch.cuda.current_device = lambda: torch.device("cpu")


def _shim_synchronize() -> None:
    """`torch.cuda.synchronize()` is a no-op (there is no device stream to wait for).

    Needed by pipeline_parallel/p2p_communication.py:398 `torch.cuda.synchronize()` (runs with the
    default `batch_p2p_comm=True, batch_p2p_sync=True`, i.e. every PP>1 step), and by
    distributed/distributed_data_parallel.py:588/611 (grad-buffer offload and restore).
    """
    torch.cuda.synchronize = lambda *args, **kwargs: None


def _shim_rng_tracker() -> None:
    """megatron's model-parallel RNG tracker keeps CPU generator states instead of CUDA ones.

    Needed by tensor_parallel/random.py:235 `orig_rng_state = torch.cuda.get_rng_state()` (in
    `CudaRNGStatesTracker.add`, reached from `model_parallel_cuda_manual_seed`), and by
    transformer/dot_product_attention.py:217 `with tensor_parallel.get_cuda_rng_tracker().fork():`
    (every attention forward, even at dropout 0), which needs the tracker to be seeded.
    """
    import megatron.core.tensor_parallel.random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """`CudaRNGStatesTracker` whose named states are states of the CPU default generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # activation recomputation saves and restores "cuda" RNG states through these two helpers
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    mrandom.initialize_rng_tracker(force_reset=True)


_FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "randperm", "as_tensor",
    "zeros_like", "ones_like", "empty_like", "full_like", "empty_strided", "linspace", "eye",
})


def _on_cpu(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if isinstance(device, int) or (device is not None and str(device).startswith("cuda")):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


class _CpuTorch(types.ModuleType):
    """Stands in for the module-global name `torch` inside megatron modules: tensor factories
    called with `device="cuda"` (or a device index) allocate on the CPU and never pin memory;
    every other attribute is torch's own."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORIES:
            factory = attr

            @functools.wraps(factory)
            def attr(*args, **kwargs):
                return factory(*args, **_on_cpu(kwargs))

        object.__setattr__(self, name, attr)  # cached: __getattr__ runs once per name
        return attr


_CPU_TORCH = _CpuTorch()

# Modules that allocate with device="cuda"; imported first so that the shim reaches them.
_CUDA_FACTORY_MODULES = (
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed",
    "megatron.core.tensor_parallel.data",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",
)


def _shim_cuda_factories() -> None:
    """Tensor factories called with `device="cuda"` inside megatron modules allocate on the CPU.

    Needed by pipeline_parallel/schedules.py:596/983/2138
    `total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")` (every schedule, including
    the no-pipelining one), optimizer/optimizer.py:907 `torch.tensor([1.0], ..., device='cuda')`
    (FP32Optimizer), transformer/utils.py:35 (the default causal mask), optimizer/clip_grads.py:90/103/175
    and dist_checkpointing/exchange_utils.py. The module-global
    `torch` of each loaded `megatron.*` module is replaced by a proxy; modules imported later are
    reached by calling `apply_cpu_shims()` again.
    """
    for name in _CUDA_FACTORY_MODULES:
        importlib.import_module(name)
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and getattr(module, "torch", None) is torch:
            module.torch = _CPU_TORCH


def _shim_tensor_type_names() -> None:
    """`Tensor.type()` (no argument) called from `megatron.core.optimizer*` reports CPU tensors
    under their CUDA type names, so that megatron's optimizers dispatch on dtype as on a GPU.

    Needed by optimizer/clip_grads.py:167 `assert param.grad.type() == 'torch.cuda.FloatTensor'`
    (every `optimizer.step()` with `clip_grad > 0`), optimizer/distrib_optimizer.py:420 (the
    distributed optimizer) and optimizer/optimizer.py:671/690 (the bf16/fp16 optimizer).
    """
    original = torch.Tensor.type

    @functools.wraps(original)
    def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and _caller_module().startswith("megatron.core.optimizer"):
                return name.replace("torch.", "torch.cuda.", 1)
            return name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = tensor_type


def _shim_tensor_cuda() -> None:
    """`Tensor.cuda()` called from a megatron module returns the tensor itself.

    Needed by models/common/language_module/language_module.py:244
    `weight.data = weight.data.cuda()` (tied embeddings with PP > 1, at model construction) and
    optimizer/distrib_optimizer.py:1089 (the `fully_reshardable` optimizer checkpoint).
    """
    original = torch.Tensor.cuda

    @functools.wraps(original)
    def tensor_cuda(self, *args, **kwargs):
        if _caller_module().startswith("megatron."):
            return self
        return original(self, *args, **kwargs)

    torch.Tensor.cuda = tensor_cuda


def _shim_current_stream() -> None:
    """`torch.cuda.current_stream()` returns a CPU stand-in whose waits are no-ops (CPU work is
    synchronous: there is nothing to wait for). megatron-core >= 0.19 only.

    Needed by 0.19.2 distributed/param_and_grad_buffer.py:632 `current_stream =
    torch.cuda.current_stream()` in `start_grad_sync` (every megatron DDP gradient sync; it waits
    on CUDA-graph events, which the CPU never records).
    """

    class CpuStream:
        def wait_event(self, event) -> None:
            pass

        def wait_stream(self, stream) -> None:
            pass

        def synchronize(self) -> None:
            pass

    stream = CpuStream()
    torch.cuda.current_stream = lambda *args, **kwargs: stream


def _shim_sequence_parallel_norm() -> None:
    """megatron's torch norms take sequence parallelism: built as without it, their parameters
    tagged `sequence_parallel` as megatron's other norms tag theirs.

    Needed by transformer/torch_norm.py:32 (0.19.2 :50) `assert not config.sequence_parallel,
    "sequence parallel not supported by torch LayerNorm"`: the local layer spec builds every RMSNorm
    as `WrappedTorchNorm` (models/backends.py:110 `LNImpl = WrappedTorchNorm`), so any sequence-parallel
    model on the CPU. The norm's maths does not depend on the split of the sequence; only its weight
    gradient is then a partial sum over this rank's tokens, which finalize_model_grads sums over the TP
    group for parameters tagged `sequence_parallel` (distributed/finalize_model_grads.py:354 in
    0.16.1), as it does for fused_layer_norm.py's and the router's (transformer/moe/router.py:74).
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, *args, **kwargs)
        plain = copy.copy(config)  # a shallow copy: TransformerConfig.__post_init__ does not run again
        plain.sequence_parallel = False
        norm = build(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = __new__


CPU_SHIMS: dict[str, Callable[[], None]] = {
    "current_device": _shim_current_device,
    "synchronize": _shim_synchronize,
    "rng_tracker": _shim_rng_tracker,
    "cuda_factories": _shim_cuda_factories,
    "tensor_type_names": _shim_tensor_type_names,
    "tensor_cuda": _shim_tensor_cuda,
    "sequence_parallel_norm": _shim_sequence_parallel_norm,
    "current_stream": _shim_current_stream,
}
# The megatron-core release that first needs a shim (the others: every verified release).
SHIM_SINCE = {"current_stream": "0.19"}


def shims_for(version: str, *, cuda: bool) -> tuple[str, ...]:
    """The CPU shims megatron-core `version` needs, in `CPU_SHIMS` order; none where `cuda` (CUDA
    is available): every shim stands in for a CUDA device or for a megatron module only GPU runs
    skip (transformer-engine's norms take sequence parallelism themselves)."""
    from packaging.version import Version

    if cuda:
        return ()
    return tuple(n for n in CPU_SHIMS if Version(version) >= Version(SHIM_SINCE.get(n, "0")))


_REPEATABLE = {"cuda_factories"}  # reaches megatron modules imported since the last call
_applied: set[str] = set()


def apply_cpu_shims(names: Optional[Sequence[str]] = None) -> tuple[str, ...]:
    """Apply the CPU shims (those the installed megatron-core needs, `shims_for`, or the named
    subset) when CUDA is unavailable.

    Idempotent; call it again after importing more megatron modules. Returns the names applied so
    far in this process (empty with CUDA). Raises `UnverifiedMegatronVersion` on a CPU-only machine
    whose megatron-core version the shims were not verified on.
    """
    if torch.cuda.is_available():
        return ()
    unknown = [n for n in names or () if n not in CPU_SHIMS]
    if unknown:
        raise ValueError(f"unknown CPU shim(s) {unknown}; known: {list(CPU_SHIMS)}")
    version = megatron_core_version()
    check_shims_verified(version)
    selected = shims_for(version, cuda=False) if names is None else list(names)
    for name in selected:
        if name not in _applied or name in _REPEATABLE:
            CPU_SHIMS[name]()
            _applied.add(name)
    return tuple(n for n in CPU_SHIMS if n in _applied)
