"""`RankedWorker`: the base of every role's Ray actor class. It knows its rank and sets up
torch.distributed; `megarl.placement.worker_group.WorkerGroup` creates and calls these actors."""
from __future__ import annotations

import datetime
import os

import ray

from megarl.config.devices import visible_gpu_index
from megarl.net import free_port


class RankedWorker:
    """Base of every role's Ray actor class: knows its rank and sets up torch.distributed."""

    def __init__(self, rank: int, world_size: int, role: str):
        self.rank, self.world_size, self.role = rank, world_size, role
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

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group."""
        return ray.util.get_node_ip_address(), free_port("")

    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> bool:
        """Join the group's torch.distributed world. With NCCL in `backend`, first select this
        rank's GPU: NCCL communicators (and the engine, megarl.engines.megatron.parallel.compute_device)
        use `torch.cuda.current_device()`, and ranks all left on device 0 would be two ranks on one
        GPU, which NCCL refuses ("Duplicate GPU detected")."""
        import torch
        import torch.distributed as dist

        if "nccl" in backend:
            if not torch.cuda.is_available():
                raise RuntimeError(f"{self.role} rank {self.rank}: backend {backend!r} needs CUDA, and this process "
                                   f"sees no GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            torch.cuda.set_device(visible_gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")))
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return True
