"""A test harness: worlds of gloo ranks running real megatron-core on CPU, for the tests and the
benchmarks (tools/bench). Nothing in the product imports it.

`init_gloo_model_parallel()` starts torch.distributed on gloo and megatron's `parallel_state` for
one rank of a TP x PP (x VPP) layout, the CPU shims applied first (`engines.megatron.cpu.shims`);
`run_gloo_workers()` starts those ranks as local processes on a free 127.0.0.1 port and fails with
the traceback of a rank that fails.
"""
from __future__ import annotations

import datetime
import logging
import os
import tempfile
import time
from typing import Callable, Optional, Sequence

import torch

from megarl.engines.megatron.cpu.shims import apply_cpu_shims
from megarl.engines.megatron.groups import initialize_model_parallel, release_model_parallel
from megarl.net import free_port

log = logging.getLogger(__name__)


def init_gloo_model_parallel(
    rank: int,
    world_size: int,
    master_port: int,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    seed: int = 1234,
    master_addr: str = "127.0.0.1",
    timeout_s: float = 120.0,
    cpu_shims: Optional[Sequence[str]] = None,
) -> None:
    """Make this process rank `rank` of a gloo world and initialise megatron's parallel_state for
    TP x PP (x VPP); data parallel is world_size / (tp * pp). Seeds megatron's RNG tracker with
    `seed`. Applies the CPU shims first (`cpu_shims`: all by default; a no-op with CUDA)."""
    import torch.distributed as dist

    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not a multiple of tp*pp = {tp}*{pp}")
    apply_cpu_shims(cpu_shims)
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    _initialize_parallel_state(tp, pp, vpp, seed)


def reinit_model_parallel(tp: int = 1, pp: int = 1, vpp: Optional[int] = None, seed: int = 1234) -> None:
    """Switch an initialised gloo world to another TP x PP (x VPP) layout, keeping the processes
    (the old layout's groups are destroyed: `megarl.engines.megatron.groups`)."""
    release_model_parallel()
    _initialize_parallel_state(tp, pp, vpp, seed)


def _initialize_parallel_state(tp: int, pp: int, vpp: Optional[int], seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _worker(rank: int, fn: Callable, world_size: int, port: int, result_dir: str, args: tuple,
            environ: dict) -> None:
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment at the call (a forkserver's child inherits the server's)
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # ranks share the cores, as under torchrun
    try:
        result = fn(rank, world_size, port, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


# what a gloo rank imports (this harness, megatron-core's model, optimizer, DDP and schedules; HF's model
# classes): the forkserver imports them once, and every rank it forks has them
FORKSERVER_PRELOADED_MODULES = ("megarl.testing", "megatron.core.models.gpt.gpt_model", "megatron.core.optimizer",
                                "megatron.core.distributed", "megatron.core.pipeline_parallel",
                                "megatron.core.dist_checkpointing", "transformers")


def lost_master_port(error_text: str) -> bool:
    """Whether a gloo world failed to form because its master port was taken between `free_port`
    choosing it and rank 0's store binding it (another process bound it meanwhile): torch's
    `DistNetworkError` "The server socket has failed to listen on any local network address ...
    EADDRINUSE". Nothing of `fn` ran then (every rank waits in the rendezvous), so the world can
    start again on another port."""
    return "server socket has failed to listen" in error_text and "EADDRINUSE" in error_text


MASTER_PORT_ATTEMPTS = 3


def run_gloo_workers(
    fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 300.0, start_method: str = "forkserver"
) -> list:
    """Run `fn(rank, world_size, master_port, *args)` in `world_size` new processes and return
    their results in rank order (each must be picklable by `torch.save`).

    `fn` must be a module-level function; it usually starts with `init_gloo_model_parallel(rank,
    world_size, master_port, ...)`. A rank that raises makes this raise
    `torch.multiprocessing.ProcessRaisedException` carrying that rank's traceback (the other ranks
    are terminated); ranks still running after `timeout_s` seconds are killed and a
    `TimeoutError` is raised. Each rank runs in the caller's environment (`os.environ`) at the call.

    `start_method` "forkserver" (the default): Python's forkserver, started by exec on the first call
    and kept for the process's life, imports `FORKSERVER_PRELOADED_MODULES` once and forks every
    rank. A rank so starts in well under a second instead of re-importing torch and megatron (about
    7 s of CPU a rank under spawn), and as safely as under spawn: the server is single-threaded and
    never computes (Python's multiprocessing docs, "forkserver"), where forking the caller itself is
    unsafe once it initialised CUDA ("The CUDA runtime does not support the fork start method",
    PyTorch's multiprocessing notes), joined a process group (the children would share its sockets),
    runs other threads (Python's `os.fork` documentation: another thread's lock stays locked in the
    child) or started a GNU OpenMP pool (libgomp is not fork-safe: a rank forked after the test
    process computed in torch on two threads hung in libgomp under MKL's vmsCos). "fork" and "spawn"
    are there for callers that need them.
    A master port lost to another process before rank 0 bound it (`lost_master_port`) starts the
    ranks again on a new one, up to `MASTER_PORT_ATTEMPTS` times in all.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method == "forkserver":  # effective until the server starts (on the first call): later calls repeat it
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOADED_MODULES))
    name = getattr(fn, "__name__", fn)
    log.info("running %s in %d gloo rank(s), started by %s", name, world_size, start_method)
    attempt = 1
    while True:
        port = free_port("127.0.0.1")
        try:
            return _run_ranks(fn, world_size, port, args, timeout_s, start_method)
        except mp.ProcessRaisedException as e:
            if attempt == MASTER_PORT_ATTEMPTS or not lost_master_port(str(e)):
                raise
            log.warning("%s: master port %d was taken before rank 0 bound it; starting the %d rank(s) again on "
                        "another port", name, port, world_size)
        attempt += 1


def _run_ranks(fn: Callable, world_size: int, port: int, args: tuple, timeout_s: float, start_method: str) -> list:
    """One start of `run_gloo_workers`' ranks on master port `port`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="megarl-gloo-") as result_dir:
        context = mp.start_processes(
            _worker, args=(fn, world_size, port, result_dir, args, dict(os.environ)), nprocs=world_size, join=False,
            start_method=start_method,
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{world_size} gloo worker(s) running {getattr(fn, '__name__', fn)} did not finish "
                        f"within {timeout_s:.0f} s"
                    )
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(timeout=10)
        return [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def run_to_completion(cmd: list[str], cwd, timeout_s: float, what: str) -> str:
    """Run `cmd` (a trainer, a tool) in its own process session, its output piped; killed as a group
    if it overruns `timeout_s` seconds. Raises AssertionError (quoting the output's end) unless it
    exits 0 in time; returns its output, stdout and stderr together."""
    import signal
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{what} did not finish in {timeout_s} s:\n{output[-5000:]}") from None
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{output[-8000:]}"
    return output


# torch.distributed's collectives and point-to-point calls, as callers name them; not `isend`/`irecv`,
# which `P2POp` checks by identity (distributed_c10d.py `_check_op`): their batches count as `batch_isend_irecv`
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "gather", "scatter", "barrier", "monitored_barrier", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list", "send", "recv", "batch_isend_irecv")


class CollectiveCounter:
    """Records every torch.distributed collective this process calls while it is open, with its caller.

    Replaces each of `COLLECTIVES` in `torch.distributed` and wherever a loaded `megatron`/`megarl`
    module bound the function by name at import (megatron's `param_and_grad_buffer` binds its
    all-gather and reduce-scatter), restoring them on exit. A collective that torch implements with
    others (`all_gather_object`) counts once. `calls`: one (name, caller) per call in call order, the
    caller "module:function" of the innermost megarl frame and, when megatron's code made the call,
    of its innermost megatron frame ("megarl... <- megatron...")."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._patched: list[tuple[object, str, object]] = []

    def __enter__(self) -> CollectiveCounter:
        import sys

        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
        by_function = {id(fn): name for name, fn in originals.items()}
        modules = [dist] + [m for key, m in list(sys.modules.items())
                            if m is not None and key.startswith(("megatron.", "megarl."))]
        for module in modules:
            for attr, value in list(vars(module).items()):
                name = by_function.get(id(value))
                if name is not None and value is originals[name]:
                    self._patched.append((module, attr, value))
                    setattr(module, attr, self._counted(name, value))
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, value in reversed(self._patched):
            setattr(module, attr, value)
        self._patched.clear()

    def _counted(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.calls.append((name, _caller()))
            return fn(*args, **kwargs)

        return counted


def _caller() -> str:
    """'megarl.a:f' (module:function) of the innermost megarl frame calling a collective (this
    module's excepted), with ' <- megatron.b:g' when megatron's code made the call."""
    import sys

    frame, own, megatron = sys._getframe(2), None, None
    while frame is not None and own is None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("megatron."):
            megatron = megatron or f"{module}:{frame.f_code.co_name}"
        elif module.startswith("megarl.") and module != __name__:
            own = f"{module}:{frame.f_code.co_name}"
        frame = frame.f_back
    return (own or "?") + (f" <- {megatron}" if megatron else "")
