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
    init_role_parallel_state(RoleLayout(tp=1, pp=world_size, vpp=1), seed=1, section="actor_rollout_ref.actor")
    return lines
