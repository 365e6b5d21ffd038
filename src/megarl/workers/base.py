"""`RankedWorker`: the base of every role's Ray actor class. It knows its rank and sets up
torch.distributed; `megarl.placement.worker_group.WorkerGroup` creates and calls these actors."""
from __future__ import annotations

import datetime
import os
from typing import Optional

import ray

from megarl.config.devices import visible_gpu_index


class RankedWorker:
    """Base of every role's Ray actor class: knows its rank and sets up torch.distributed."""

    def __init__(self, rank: int, world_size: int, role: str):
        self.rank, self.world_size, self.role = rank, world_size, role
        self._group_store = None  # rank 0's, from master_address()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))

    def node_info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": os.getpid(),
        }

    def master_address(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0 only: host the group's TCPStore on this node, on a port the OS picks, and say
        where it listens. It listens before any rank is asked to join, so no port picked earlier can
        have been taken meanwhile and no joining rank retries against a port nobody listens on."""
        import torch.distributed as dist

        if self.rank != 0:
            raise RuntimeError(f"{self.role} rank {self.rank}: only rank 0 hosts the process group's store")
        address = ray.util.get_node_ip_address()
        self._group_store = dist.TCPStore(address, 0, self.world_size, is_master=True, wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=timeout_s))
        return address, self._group_store.port

    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float,
                           collective_timeout_s: Optional[float] = None) -> bool:
        """Join the group's torch.distributed world. `timeout_s` (seconds) bounds joining the
        store; `collective_timeout_s` (seconds; None: `timeout_s`) every collective of the world
        (groups made later set their own). With NCCL in `backend`, first select this rank's GPU:
        NCCL communicators (and the engine, megarl.engines.megatron.parallel.compute_device) use
        `torch.cuda.current_device()`, and ranks all left on device 0 would be two ranks on one GPU,
        which NCCL refuses ("Duplicate GPU detected")."""
        import torch
        import torch.distributed as dist

        if "nccl" in backend:
            if not torch.cuda.is_available():
                raise RuntimeError(f"{self.role} rank {self.rank}: backend {backend!r} needs CUDA, and this process "
                                   f"sees no GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            torch.cuda.set_device(visible_gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")))
        join_timeout = datetime.timedelta(seconds=timeout_s)
        if self.rank == 0:
            store = self._group_store
            if store is None:
                raise RuntimeError(f"{self.role} rank 0: master_address() hosts the group's store; call it first")
        else:
            store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=False, timeout=join_timeout)
        collective_s = timeout_s if collective_timeout_s is None else collective_timeout_s
        collective_timeout = datetime.timedelta(seconds=collective_s)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=collective_timeout)
        return True
