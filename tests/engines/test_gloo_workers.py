"""How the CPU gloo worlds start their ranks: fork (no re-import of torch and megatron) only where
forking is safe, each case against the rule it follows; and again on a new master port when the
first was taken before rank 0 bound it."""
import socket

import pytest
import torch.multiprocessing as mp

from megarl import testing
from megarl.testing import gloo_start_method, lost_master_port, run_gloo_workers
from megarl.net import free_port as real_free_port


def test_fork_only_without_cuda_a_process_group_or_other_threads():
    assert gloo_start_method(False, False, python_threads=1, os_threads=2, os_threads_at_import=2) == "fork"
    # "The CUDA runtime does not support the fork start method" (PyTorch's multiprocessing notes)
    assert gloo_start_method(True, False, python_threads=1, os_threads=2, os_threads_at_import=2) == "spawn"
    # the children would share this process's process-group sockets
    assert gloo_start_method(False, True, python_threads=1, os_threads=2, os_threads_at_import=2) == "spawn"
    # another thread's locks stay locked forever in the child (Python's os.fork documentation)
    assert gloo_start_method(False, False, python_threads=2, os_threads=3, os_threads_at_import=2) == "spawn"
    # a native pool (libgomp's) started since the import: a child entering a parallel region hangs
    assert gloo_start_method(False, False, python_threads=1, os_threads=4, os_threads_at_import=2) == "spawn"


def test_a_parallel_torch_op_makes_the_worlds_spawn():
    """A fresh interpreter: fork right after the import. After a parallel torch op on two threads the
    OS lists torch's intra-op pool (OpenMP's workers), which Python's `threading` does not see: the
    worlds spawn (a rank forked beside such a pool hung in libgomp)."""
    import subprocess
    import sys

    probe = ("import threading, torch; from megarl import testing as t; "
             "decide = lambda: t.gloo_start_method(False, False, threading.active_count(), t.os_thread_count(), "
             "t.OS_THREADS_AT_IMPORT); before = decide(); "
             "torch.set_num_threads(2); torch.rand(512, 512).cos().sum(); print(before, decide(), threading.active_count())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.split() == ["fork", "spawn", "1"], out


# A master port lost to another process between `free_port` and rank 0's bind (seen in CI, where
# the two test lines start servers and worlds at once): the world starts again on another port.
TORCH_EADDRINUSE = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
                    "address. port: 36067, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")


def _sum_of_ranks(rank, world_size, port):
    """A bare gloo world: (its master port, the all-reduced sum of rank + 1)."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return port, total.item()


def _fails(rank, world_size, port):
    raise ValueError(f"rank {rank} failed")


def test_only_a_lost_master_port_is_recognised():
    assert lost_master_port(TORCH_EADDRINUSE)  # torch's message, as a CI run printed it
    assert not lost_master_port("ValueError: rank 0 failed")
    assert not lost_master_port("RuntimeError: EADDRINUSE from a server the function started")


def test_a_master_port_taken_before_rank_0_binds_it_starts_the_world_again(monkeypatch):
    chosen = []

    def free_port_taken_first(host):
        chosen.append(taken.getsockname()[1] if not chosen else real_free_port(host))
        return chosen[-1]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()  # another process holds the first port chosen
        monkeypatch.setattr(testing, "free_port", free_port_taken_first)
        results = run_gloo_workers(_sum_of_ranks, 2, timeout_s=120)
    assert len(chosen) == 2 and chosen[0] != chosen[1]
    assert results == [(chosen[1], 3.0), (chosen[1], 3.0)]


def test_other_failures_are_not_started_again(monkeypatch):
    chosen = []
    monkeypatch.setattr(testing, "free_port", lambda host: chosen.append(real_free_port(host)) or chosen[-1])
    with pytest.raises(mp.ProcessRaisedException, match="rank . failed"):
        run_gloo_workers(_fails, 2, timeout_s=120)
    assert len(chosen) == 1
