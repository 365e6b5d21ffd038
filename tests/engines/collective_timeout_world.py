"""Body of the collective-timeout check, run in gloo processes (see test_collective_timeout.py)."""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

JOIN_TIMEOUT_S = 60.0  # seconds: the worker group's bound on joining the world, not its collectives'


def ref_config(model_dir, world_size: int, nccl_timeout_s: float):
    """A CPU experiment whose reference model runs at TP = `world_size`, with the key under test."""
    from megarl.config import load_config

    return load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.dtype=float32",
        "trainer.device=cpu", "actor_rollout_ref.rollout.name=cpu", f"trainer.n_gpus_per_node={world_size}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={world_size}",
        f"actor_rollout_ref.nccl_timeout={nccl_timeout_s}",
    ])


def timeout_world(rank: int, world_size: int, port: int, model_dir: str, nccl_timeout_s: float) -> dict:
    """The role's world as a training worker joins it (`TrainWorker.init_process_group`) and
    megatron's groups as the engine builds them (`RefEngine`); then rank 1 never enters a
    collective (it waits on the store, alive, until rank 0 is done) while rank 0 all-reduces on
    megatron's tensor-parallel group and on the world, both at once (each group's bound runs on its
    own, so the two waits overlap). Rank 0 returns, per group, (seconds from the start until its
    all-reduce's wait returned, its error or None)."""
    from megatron.core import parallel_state

    from megarl.engines.megatron.roles import RefEngine
    from megarl.workers.train_worker import TrainWorker

    config = ref_config(model_dir, world_size, nccl_timeout_s)
    worker = TrainWorker(rank, world_size, "ref", config)
    if rank == 0:  # what master_address() does, on the port the harness chose
        worker._group_store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                                            timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    worker.init_process_group("127.0.0.1", port, "gloo", JOIN_TIMEOUT_S)
    RefEngine(config)
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.wait(["rank 0 done"], datetime.timedelta(seconds=120))
        return {}
    results = {}
    start = time.monotonic()
    works = {name: dist.all_reduce(torch.ones(1), group=group, async_op=True)
             for name, group in (("tensor_model_parallel", parallel_state.get_tensor_model_parallel_group()),
                                 ("world", None))}
    for name, work in works.items():
        error = None
        try:
            work.wait()
        except Exception as e:  # gloo raises when the group's timeout passes
            error = f"{type(e).__name__}: {e}"
        results[name] = (time.monotonic() - start, error)
    store.set("rank 0 done", "1")
    return results
