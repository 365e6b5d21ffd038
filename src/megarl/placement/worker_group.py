"""Worker groups: the Ray actors of one role, one per rank (training) or per server (rollout),
pinned to the bundles the plan gives them, with calls on all ranks that never wait forever.

A role's actor class subclasses `megarl.workers.base.RankedWorker` (it has what `RankedActor`
names); the controller does

    group = WorkerGroup(ActorWorker, plan.roles["actor"], pools)
    group.init_process_group(backend="gloo")
    losses = group.call("update_policy", batch, timeout_s=600)

A rank that does not answer within the timeout, dies, or raises is reported by rank and node; a rank
that dies ends the wait at once (its peers get a short grace), naming the process, address and cause.
"""
from __future__ import annotations

import re
import time
from typing import Protocol

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.placement.planner import RolePlacement
from megarl.placement.ray_pools import RealisedPools

JOIN_GRACE_S = 30.0  # how much longer than its ranks the driver waits for a group to form (s)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerGroupError(RuntimeError):
    pass


_RAY_DEATH_FIELDS = {
    "pid": re.compile(r"^\s*pid: (\d+)$", re.M),
    "ip": re.compile(r"^\s*ip: (\S+)$", re.M),
    "exit_type": re.compile(r"Worker exit type: (\w+)"),
    "exit_detail": re.compile(r"Worker exit detail: (.*?\.)(?: |$)"),
}


def describe_actor_death(ray_message: str) -> str:
    """One line on why a Ray actor died, from the text of its `RayActorError`: which process on
    which address, what probably happened, and Ray's own first words on it."""
    found = {k: (m.group(1) if (m := p.search(ray_message)) else None) for k, p in _RAY_DEATH_FIELDS.items()}
    process = "the worker process"
    if found["pid"] or found["ip"]:
        process += " (" + ", ".join(filter(None, [found["pid"] and f"pid {found['pid']}",
                                                   found["ip"] and f"node {found['ip']}"])) + ")"
    exit_type = found["exit_type"] or ""
    if "creation task" in ray_message:
        what = f"{process} failed while starting: {ray_message.splitlines()[0]}"
    elif exit_type in ("SYSTEM_ERROR", "UNEXPECTED_SYSTEM_EXIT"):
        what = f"{process} exited unexpectedly (SIGKILL, the OOM killer or a crash?)"
    elif exit_type == "INTENDED_USER_EXIT":
        what = f"{process} was stopped on purpose (ray.kill or exit_actor)"
    elif "NODE" in exit_type:
        what = f"{process} was lost with its node"
    else:
        what = f"{process} is gone: {ray_message.splitlines()[0]}"
    detail = found["exit_detail"]
    return f"{what}; Ray: {exit_type + ': ' if exit_type else ''}{detail}" if detail else what


class RankedActor(Protocol):
    """What `WorkerGroup` needs of a role's actor class (`megarl.workers.base.RankedWorker` is the
    implementation): it is created as `cls(rank, world_size, role_name, *args, **kwargs)` and answers
    these two calls."""

    def master_address(self, timeout_s: float) -> tuple[str, int]: ...

    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> bool: ...


class WorkerGroup:
    """The actors of one role. Rank r of a training role sits on bundle r of its pool; a rollout
    server has one actor per node it spans (`RolePlacement.server_processes`, in that order), each
    on the server's first GPU of that node."""

    def __init__(self, worker_cls: type[RankedActor], role: RolePlacement, pools: RealisedPools, *args,
                 env: dict[str, str] | None = None, **kwargs):
        self.role = role
        group = pools.groups[role.pool]
        node_names = [n.name for n in pools.nodes]
        if role.kind == "rollout":
            bundles = [first_gpu for _, _, first_gpu in role.server_processes()]
        else:
            bundles = list(range(role.world_size))
        self.locations = [node_names[role.devices[b].node] for b in bundles]
        remote_cls = ray.remote(worker_cls)
        self.actors = [
            remote_cls.options(
                num_cpus=0,
                num_gpus=role.gpu_fraction,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b),
                runtime_env={"env_vars": dict(env or {})},
            ).remote(rank, len(bundles), role.name, *args, **kwargs)
            for rank, b in enumerate(bundles)
        ]

    def __len__(self) -> int:
        return len(self.actors)

    def _where(self, rank: int) -> str:
        return f"{self.role.name} rank {rank} on {self.locations[rank]}"

    def _gather(self, refs: list, what: str, timeout_s: float, ranks: list[int] | None = None,
                death_grace_s: float = 10.0) -> list:
        """Results in order of `refs` (of `ranks`, default all). A rank that dies ends the wait
        early: its peers are likely blocked in a collective with it, so they get `death_grace_s`
        more to answer, then all are reported."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        deadline = time.monotonic() + timeout_s
        pending, outcomes, died = list(refs), {}, False
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=deadline - time.monotonic())
            for ref in ready:
                try:
                    outcomes[ref] = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    outcomes[ref] = exc
                    if isinstance(exc, RayActorError) and not died:
                        died, deadline = True, min(deadline, time.monotonic() + death_grace_s)
        if pending and not died:
            names = ", ".join(self._where(ranks[refs.index(r)]) for r in pending)
            raise WorkerGroupError(f"{what}: no answer within {timeout_s:g} s from {names}")
        deaths, failures = [], []  # deaths first: the others often fail because of them
        for rank, ref in zip(ranks, refs):
            outcome = outcomes.get(ref)
            if ref in pending:
                failures.append(f"{self._where(rank)} gave no answer {death_grace_s:g} s after another rank died")
            elif isinstance(outcome, RayActorError):
                deaths.append(f"{self._where(rank)} died: {describe_actor_death(str(outcome))}")
            elif isinstance(outcome, RayTaskError) and died:  # most likely a collective with the dead rank
                cause = outcome.cause
                first_line = (str(cause).splitlines() or [""])[0]
                failures.append(f"{self._where(rank)} raised {type(cause).__name__}: {first_line}")
            elif isinstance(outcome, RayTaskError):  # the method raised: its own type, message and traceback
                cause = outcome.cause
                remote = _ANSI.sub("", str(outcome)).strip().replace("\n", "\n      ")
                failures.append(f"{self._where(rank)} raised {type(cause).__name__}: {cause}\n      {remote}")
        failures = deaths + failures
        if failures:
            raise WorkerGroupError(f"{what} failed:\n" + "\n".join(f"  - {f}" for f in failures))
        return [outcomes[ref] for ref in refs]

    def call(self, method: str, *args, timeout_s: float = 600.0, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; results in rank order."""
        refs = [getattr(a, method).remote(*args, **kwargs) for a in self.actors]
        return self._gather(refs, f"{self.role.name}.{method}", timeout_s)

    def call_each(self, method: str, per_rank_args: list[tuple], timeout_s: float = 600.0) -> list:
        """Call `method` on rank r with per_rank_args[r]; results in rank order."""
        if len(per_rank_args) != len(self.actors):
            raise ValueError(f"{len(per_rank_args)} argument tuples for {len(self.actors)} ranks")
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return self._gather(refs, f"{self.role.name}.{method}", timeout_s)

    def call_ranks(self, ranks: list[int], method: str, *args, timeout_s: float = 600.0, **kwargs) -> list:
        """Call `method` with the same arguments on the given ranks only; results in their order."""
        refs = [getattr(self.actors[r], method).remote(*args, **kwargs) for r in ranks]
        return self._gather(refs, f"{self.role.name}.{method}", timeout_s, ranks)

    def init_process_group(self, backend: str, timeout_s: float = 120.0) -> tuple[str, int]:
        """Form one torch.distributed group over the ranks, its store hosted by rank 0. `backend`:
        "gloo" on CPU, "cpu:gloo,cuda:nccl" for training on GPUs (megarl.config.devices decides
        it). The ranks give up after `timeout_s`; we wait JOIN_GRACE_S longer, so that a group that
        does not form is reported by the ranks' own errors (which rank's key never came)."""
        addr, port = self._gather([self.actors[0].master_address.remote(timeout_s)], "master_address", timeout_s)[0]
        self.call("init_process_group", addr, port, backend, timeout_s, timeout_s=timeout_s + JOIN_GRACE_S)
        return addr, port

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
