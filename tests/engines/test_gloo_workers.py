"""How the CPU gloo worlds start their ranks: forked by a forkserver that imported torch and
megatron once, in the caller's environment at the call, safe after the caller computed on an OpenMP
pool; and again on a new master port when the first was taken before rank 0 bound it."""
import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

from megarl import testing
from megarl.net import free_port as real_free_port
from megarl.testing import lost_master_port, run_gloo_workers


def _what_the_rank_has(rank, world_size, port):
    """(megatron's GPT model imported before this function ran, MEGARL_PROBE in this rank's environment)."""
    return "megatron.core.models.gpt.gpt_model" in sys.modules, os.environ.get("MEGARL_PROBE")


def test_ranks_start_with_megatron_imported_and_the_callers_environment_at_the_call(monkeypatch):
    """Nothing this test module imports loads megatron's GPT model: a spawned rank would not have it.
    The second world's variable was set after the forkserver started (by the first world, or an
    earlier test's), and its ranks see it."""
    monkeypatch.setenv("MEGARL_PROBE", "first")
    assert run_gloo_workers(_what_the_rank_has, 2, timeout_s=120) == [(True, "first")] * 2
    monkeypatch.setenv("MEGARL_PROBE", "second")
    assert run_gloo_workers(_what_the_rank_has, 1, timeout_s=120) == [(True, "second")]
    assert run_gloo_workers(_what_the_rank_has, 1, timeout_s=120, start_method="spawn") == [(False, "second")]


def _cosines_on_two_threads(rank, world_size, port):
    torch.set_num_threads(2)
    return float(torch.rand(2048, 2048).cos().sum())


def test_ranks_compute_on_two_threads_after_the_caller_did():
    """The caller's OpenMP pool is running: a rank forked from the caller itself hangs in libgomp on
    its first parallel region (MKL's vmsCos; seen with torch for Python 3.12, within the 60 s bound
    every time tried), one from the forkserver computes."""
    torch.set_num_threads(2)
    torch.rand(512, 512).cos().sum()
    values = run_gloo_workers(_cosines_on_two_threads, 2, timeout_s=120)
    assert len(values) == 2 and all(v == v for v in values)  # finished, not NaN


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
