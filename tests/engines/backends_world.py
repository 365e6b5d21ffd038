"""Body of the process-group backend check, run in forked gloo processes (see engine_world.py)."""
from __future__ import annotations

import logging

from engine_world import init_world


def backends_world(rank: int, world_size: int, port: int) -> dict:
    """Start a gloo world as the worker group does, initialise megatron at PP=world_size: "lines", the
    `megarl.engines` log lines this rank wrote at INFO meanwhile. Then this rank's threads and registered
    process groups after a switch to TP1 x PP1 ("first") and after three more layout switches
    (`reinit_model_parallel`, as the bridge and sync test worlds do; "after")."""
    import os

    from torch.distributed import distributed_c10d

    from megarl.engines.megatron.parallel import RoleLayout, init_role_parallel_state
    from megarl.testing import reinit_model_parallel

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(f"{record.levelname} {record.getMessage()}")

    logger = logging.getLogger("megarl.engines")
    logger.setLevel(logging.INFO)
    keep = Keep()
    logger.addHandler(keep)
    init_world(rank, world_size, port)
    init_role_parallel_state(RoleLayout(tp=1, pp=world_size, vpp=1), seed=1, section="actor_rollout_ref.actor",
                             collective_timeout_s=1800.0)
    logger.removeHandler(keep)

    def counts() -> dict:
        return {"threads": len(os.listdir("/proc/self/task")), "groups": len(distributed_c10d._world.pg_map)}

    reinit_model_parallel(1, 1)
    first = counts()
    for tp, pp in ((2, 1), (1, 2), (1, 1)):
        reinit_model_parallel(tp, pp)
    return {"lines": list(lines), "first": first, "after": counts()}
