"""Worker groups: the Ray actors of one role, one per rank (training) or per server (rollout),
pinned to the bundles the plan gives them, with calls on all ranks that never wait forever.

A role's actor class subclasses `megarl.workers.base.RankedWorker` (it has what `RankedActor`
names); the controller does

    group = WorkerGroup(TrainWorker, plan.roles["actor"], pools, config)
    group.init_process_group(backend="gloo")
    metrics = group.call(TrainWorker.push_weights, timeout_s=600)

A call names the worker class's method itself (`TrainWorker.push_weights`), never its name as a
string: a reader, an IDE or a rename follows it into the worker. This module is the one place
that turns it into Ray's remote call by name. A call through a worker's dispatcher
(`TrainWorker.run_engine`) is reported by the name of what it dispatches (`call_name`).

A rank that does not answer within the timeout, dies, or raises is reported by rank and node. The
first rank that dies, or in a training role raises, ends the call on every rank within seconds: its
peers get a short grace, then those still inside the call (blocked in a collective with it) are
stopped with their group, and the first failure is reported first, naming the process, address and
cause. The driver waits in short slices, so Ctrl-C and SIGTERM are handled while it waits.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megarl.placement.planner import RolePlacement
from megarl.placement.ray_pools import RealisedPools

JOIN_GRACE_S = 30.0  # how much longer than its ranks the driver waits for a group to form (s)
# The driver's longest single wait inside Ray's C code, where Python runs no signal handler (s):
# SIGINT and SIGTERM are handled within one slice wherever the driver waits on its workers.
WAIT_SLICE_S = 0.5
# After a rank's call failed, how long its peers get to end theirs (s): a peer in a collective with
# the failed rank usually fails at once (gloo: its connection closed; NCCL: the communicator's
# error); one that does not is blocked, and is stopped with its group (`WorkerGroup.abort`).
FAILURE_GRACE_S = 10.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
log = logging.getLogger("megarl.placement")
R = TypeVar("R")


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


def _wait(refs: list, timeout_s: float) -> tuple[list, list]:
    """`ray.wait` for all of `refs` up to `timeout_s`: (ready, pending). Ray's Cython wait runs
    Python's signal handlers while it waits; when one raises (a stop signal: Preempted,
    KeyboardInterrupt), the wait returns with that exception set and Python reports a SystemError
    caused by it: the handler's own exception is raised instead."""
    try:
        return ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except SystemError as error:
        if error.__cause__ is None:
            raise
        raise error.__cause__ from None


class RankedActor(Protocol):
    """What `WorkerGroup` needs of a role's actor class (`megarl.workers.base.RankedWorker` is the
    implementation): it is created as `cls(rank, world_size, role_name, *args, **kwargs)` and answers
    these two calls."""

    def master_address(self, timeout_s: float) -> tuple[str, int]: ...

    def init_process_group(self, master_addr: str, master_port: int, backend: str, timeout_s: float) -> bool: ...


class WorkerGroup:
    """The actors of one role. Rank r of a training role sits on the pool's plan device r; a
    rollout server has one actor per node it spans (`RolePlacement.server_processes`, in that
    order), each on the server's first GPU of that node. A plan device runs on the bundle that got
    its GPU (`RealisedPools.bundle_of`), not on the bundle of its index; `gpus[rank]` is the GPU."""

    def __init__(self, worker_cls: type[RankedActor], role: RolePlacement, pools: RealisedPools, *args,
                 env: dict[str, str] | None = None, collective: bool = True, **kwargs):
        """`collective`: the ranks call collectives together (a training role), so one rank's
        failure ends the call on all (`_gather`); False for workers that each own an independent
        process (rollout servers)."""
        self.role = role
        self.worker_cls = worker_cls
        self.collective = collective
        self.stopped: str | None = None  # why `abort` stopped the workers, once it has
        group = pools.groups[role.pool]
        node_names = [n.name for n in pools.nodes]
        if role.kind == "rollout":
            devices = [first_gpu for _, _, first_gpu in role.server_processes()]
        else:
            devices = list(range(role.world_size))
        self.locations = [node_names[role.devices[i].node] for i in devices]
        self.gpus = [pools.device_gpu(role.pool, i) for i in devices]
        remote_cls = ray.remote(worker_cls)
        self.actors = [
            remote_cls.options(
                num_cpus=0,
                num_gpus=role.gpu_fraction,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=pools.bundle_of(role.pool, i)),
                runtime_env={"env_vars": dict(env or {})},
            ).remote(rank, len(devices), role.name, *args, **kwargs)
            for rank, i in enumerate(devices)
        ]

    def __len__(self) -> int:
        return len(self.actors)

    def _where(self, rank: int) -> str:
        return f"{self.role.name} rank {rank} on {self.locations[rank]}"

    def _gather(self, refs: list, what: str, timeout_s: float, ranks: list[int] | None = None) -> list:
        """Results in order of `refs` (of `ranks`, default all). The driver waits in slices of
        `WAIT_SLICE_S`, so a stop signal is handled within one slice wherever it waits.

        The first rank whose call fails ends the wait early: a rank that dies, or in a
        `collective` group one that raises (its peers are likely blocked in a collective with it).
        The others get `FAILURE_GRACE_S` more to answer; in a collective group, the ranks still
        inside the call then are stopped with the whole group (`abort`), so no rank is left
        waiting in a collective until its timeout. All are reported, the first failure first."""
        if self.stopped is not None:
            raise WorkerGroupError(f"{what}: {self.role.name}'s workers were stopped after an earlier failure "
                                   f"({self.stopped})")
        ranks = list(range(len(refs))) if ranks is None else ranks
        started = time.monotonic()
        deadline = started + timeout_s
        pending, outcomes, failed = list(refs), {}, []  # failed: refs in the order their failure came
        while pending and time.monotonic() < deadline:
            slice_s = min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            ready, pending = _wait(pending, slice_s)
            for ref in ready:
                try:
                    outcomes[ref] = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    outcomes[ref] = exc
                    ends_the_call = isinstance(exc, RayActorError) or self.collective
                    if ends_the_call and not failed:
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                    failed.append(ref)
        # the cause first: a rank that died (its peers' errors in a collective with it follow), else the
        # first rank that raised in a collective group; the others in the order their failures came
        deaths = [r for r in failed if isinstance(outcomes[r], RayActorError)]
        failed = deaths + [r for r in failed if r not in deaths]
        first = failed[0] if deaths or (failed and self.collective) else None
        lines = [self._failure(ranks[refs.index(r)], outcomes[r], brief=first is not None and r is not first)
                 for r in failed]
        if pending and first is None:
            names = ", ".join(self._where(ranks[refs.index(r)]) for r in pending)
            if self.collective:
                self.abort(f"{what} gave no answer within {timeout_s:g} s")
            raise WorkerGroupError(f"{what}: no answer within {timeout_s:g} s from {names}"
                                   + "".join(f"\n  - {line}" for line in lines))
        if not failed:
            return [outcomes[ref] for ref in refs]
        first_where = self._where(ranks[refs.index(first)]) if first is not None else None
        for ref in pending:
            lines.append(f"{self._where(ranks[refs.index(ref)])} was still inside the call {FAILURE_GRACE_S:g} s "
                         f"after {first_where} failed" + (": stopped (presumably blocked in a collective with it)"
                                                           if self.collective else ""))
        if pending and self.collective:
            self.abort(f"{what}: {first_where} failed while its peers were inside the call")
        raise WorkerGroupError(f"{what} failed:\n" + "\n".join(f"  - {line}" for line in lines))

    def _failure(self, rank: int, outcome: BaseException, brief: bool) -> str:
        """One report line for a rank whose call died or raised; `brief`: its exception's type and
        first line only (a rank that failed after the first one, most likely because of it)."""
        if isinstance(outcome, RayActorError):
            return f"{self._where(rank)} died: {describe_actor_death(str(outcome))}"
        cause = outcome.cause
        if brief:
            return f"{self._where(rank)} raised {type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
        remote = _ANSI.sub("", str(outcome)).strip().replace("\n", "\n      ")
        return f"{self._where(rank)} raised {type(cause).__name__}: {cause}\n      {remote}"

    def abort(self, reason: str) -> None:
        """Stop every worker of the group (their processes end; a rank blocked in a collective
        cannot be reached any other way on gloo, and NCCL's abort would leave the group unusable
        all the same). Later calls raise at once, naming `reason`."""
        log.error("%s: stopping the %d workers of %s", reason, len(self.actors), self.role.name)
        self.stopped = reason
        for actor in self.actors:
            ray.kill(actor)

    def _remote_name(self, method: Callable) -> str:
        """The name Ray calls `method` by on this group's actors. `method` is a method of the
        group's worker class or of a class it derives from (`TrainWorker.node_info`);
        a subclass's override of it is what runs."""
        name = getattr(method, "__name__", None)
        if not any(name in vars(cls) and vars(cls)[name] is method for cls in self.worker_cls.__mro__):
            raise TypeError(f"{self.role.name}: {method!r} is not a method of its workers' class "
                            f"{self.worker_cls.__name__}")
        return name

    def call(self, method: Callable[..., R], *args: Any, timeout_s: float = 600.0, call_name: str | None = None,
             **kwargs: Any) -> list[R]:
        """Call the workers' `method` with the same arguments on every rank; results in rank order.
        `call_name`: the call's name in reports (default `method`'s)."""
        name = self._remote_name(method)
        refs = [getattr(a, name).remote(*args, **kwargs) for a in self.actors]
        return self._gather(refs, f"{self.role.name}.{call_name or name}", timeout_s)

    def call_each(self, method: Callable[..., R], per_rank_args: list[tuple], timeout_s: float = 600.0,
                  call_name: str | None = None) -> list[R]:
        """Call the workers' `method` on rank r with per_rank_args[r]; results in rank order.
        `call_name`: the call's name in reports (default `method`'s)."""
        name = self._remote_name(method)
        what = f"{self.role.name}.{call_name or name}"
        if len(per_rank_args) != len(self.actors):
            raise ValueError(f"{what}: {len(per_rank_args)} argument tuples for {len(self.actors)} ranks")
        refs = [getattr(a, name).remote(*args) for a, args in zip(self.actors, per_rank_args)]
        return self._gather(refs, what, timeout_s)

    def call_ranks(self, ranks: list[int], method: Callable[..., R], *args: Any, timeout_s: float = 600.0,
                   **kwargs: Any) -> list[R]:
        """Call the workers' `method` with the same arguments on the given ranks only; results in their order."""
        name = self._remote_name(method)
        refs = [getattr(self.actors[r], name).remote(*args, **kwargs) for r in ranks]
        return self._gather(refs, f"{self.role.name}.{name}", timeout_s, ranks)

    def init_process_group(self, backend: str, timeout_s: float = 120.0) -> tuple[str, int]:
        """Form one torch.distributed group over the ranks, its store hosted by rank 0. `backend`:
        "gloo" on CPU, "cpu:gloo,cuda:nccl" for training on GPUs (megarl.config.devices decides
        it). The ranks give up after `timeout_s`; we wait JOIN_GRACE_S longer, so that a group that
        does not form is reported by the ranks' own errors (which rank's key never came)."""
        addr, port = self._gather([self.actors[0].master_address.remote(timeout_s)],
                                  f"{self.role.name}.master_address", timeout_s)[0]
        refs = [a.init_process_group.remote(addr, port, backend, timeout_s) for a in self.actors]
        self._gather(refs, f"{self.role.name}.init_process_group", timeout_s + JOIN_GRACE_S)
        return addr, port

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
