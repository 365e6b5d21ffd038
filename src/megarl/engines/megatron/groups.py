"""megatron-core's process groups, created and released as a pair.

`parallel_state.destroy_model_parallel()` only forgets megatron's references to its groups; the
groups stay registered in torch.distributed. Each gloo group keeps three threads (its TCP loop and
two work threads) until it is destroyed there, and megatron-core creates 20 (0.16.1) to 37 (0.19)
groups per layout, its gloo copies of the data-parallel groups included. A gloo world that switched
layouts (the bridge and sync tests, one world per module) reached 163 groups and 490 threads per
rank and starved every other process on a 2-core machine: gloo timeouts in unrelated tests.
`release_model_parallel` destroys exactly the groups `initialize_model_parallel` created. Only gloo
worlds switch layouts: an engine on GPUs initialises its layout once per process.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d

_created: list = []  # the torch.distributed groups the last `initialize_model_parallel` created


def _registered() -> set:
    # torch.distributed has no public list of its groups; `_world.pg_map` is that list (ProcessGroup -> backend, store)
    return set(distributed_c10d._world.pg_map)


def initialize_model_parallel(**sizes) -> None:
    """`parallel_state.initialize_model_parallel(**sizes)`, remembering the groups it creates."""
    from megatron.core import parallel_state

    before = _registered()
    parallel_state.initialize_model_parallel(**sizes)
    _created.extend(group for group in _registered() - before if group is not dist.GroupMember.WORLD)


def release_model_parallel() -> None:
    """Forget megatron's parallel state and destroy the groups `initialize_model_parallel` created
    (every rank of the world calls it, as it switches layouts)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    registered = _registered()
    while _created:
        group = _created.pop()
        if group in registered:
            dist.destroy_process_group(group)
