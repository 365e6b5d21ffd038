"""Body of the process-group backend check, run in spawned gloo processes (see engine_world.py)."""
from __future__ import annotations

import logging

from engine_world import init_world


def backends_world(rank: int, world_size: int, port: int) -> list[str]:
    """Start a gloo world as the worker group does, initialise megatron at PP=world_size; return the
    `megarl.engines` log lines this rank wrote at INFO."""
    from megarl.engines.megatron.parallel import RoleLayout, init_role_parallel_state

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger("megarl.engines")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    init_world(rank, world_size, port)
    init_role_parallel_state(RoleLayout(tp=1, pp=world_size, vpp=1), seed=1, section="actor_rollout_ref.actor",
                             collective_timeout_s=1800.0)
    return lines


def layout_switch_world(rank: int, world_size: int, port: int) -> dict:
    """This rank's threads and registered process groups after megatron's first layout and after
    three layout switches (`reinit_model_parallel`), as the bridge and sync test worlds do."""
    import os

    from torch.distributed import distributed_c10d

    from megarl.testing import init_gloo_model_parallel, reinit_model_parallel

    def counts() -> dict:
        return {"threads": len(os.listdir("/proc/self/task")), "groups": len(distributed_c10d._world.pg_map)}

    init_gloo_model_parallel(rank, world_size, port, tp=1, pp=1)
    first = counts()
    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        reinit_model_parallel(tp, pp)
    return {"first": first, "after": counts()}
