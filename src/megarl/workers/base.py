"""`RankedWorker`: the base of every role's Ray actor class. It knows its rank and sets up
torch.distributed; `megarl.placement.worker_group.WorkerGroup` creates and calls these actors."""
from __future__ import annotations

import datetime
import os

import ray

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
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return True
