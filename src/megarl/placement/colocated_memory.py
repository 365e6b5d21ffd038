"""The colocated GPUs' memory as one state machine: which memory each rollout server holds, which
training states each role holds, the moves SGLang allows, and the order of a colocated step.
Pure: the runtime (`runtime/cluster.py`, each phase of a step) asks it what to do next, does it,
and reports back; the weight push is told per server what to resume and what to flush.

Rollout servers (SGLang 0.5.23, managers/scheduler_components/weight_updater.py): memory comes in
three tags, `weights`, `kv_cache` and `cuda_graph`, each resident or released.
  - `/release_memory_occupation` asserts the server is idle (an assertion in its scheduler, which
    then exits: the server dies);
  - `/resume_memory_occupation` removes each tag from the released ones, `offload_tags.remove(tag)`:
    resuming a tag that is resident raises KeyError in the scheduler, which exits: the server dies.
    So nothing is resumed that was not released, and a restarted server (all resident) never is;
  - `weights` come back before a push (the push writes into them) and `kv_cache`, `cuda_graph`
    after it (SGLang's own order, slime's and verl's).
Training roles: the parts `colocation.offload_plan` names (parameters, gradients, optimizer state)
are on the device or offloaded.

The order of one colocated step (`COLOCATED_ORDER`; `memory.estimate` models its three phases):
  training  before it, every server releases what it holds, then every planned part comes back
  push      before it, every planned part except the actor's parameters (which the push reads)
            leaves the device, the training processes empty their allocators' caches (SGLang's
            memory saver maps its memory again from what is physically free), then the servers'
            weights come back; the push drops each bucket once answered
  rollout   after the push, the actor's planned parameters leave too, the caches are emptied
            again, then the servers' KV cache and CUDA graphs come back
With `rollout.free_cache_engine` false the servers keep all their memory: nothing is released or
resumed, and a push flushes their KV cache instead (`flush_before_push`).

Restarts (a server that died or hung, started again by the rollout fleet): SGLang sizes a server's
KV cache from the device memory free when it starts (model_runner's memory profile, a fraction of
what is free after its weights load), so
  restart   before it, every planned part leaves the device and the caches are emptied
            (`before_restart`): the server sizes its memory from what the trainer leaves free
            while generating, wherever the restart comes in the step; it then holds all its memory
  push      a push that finds servers holding memory (a restarted one; all of them when the push
            re-gives the weights between generations) has them release everything first (when
            servers release at all): the actor then comes back (all of it, `onload`) in the
            training phase's memory, never beside a server's KV cache and CUDA graphs
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.placement.colocation import OffloadParts

TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang 0.5.23's GPU_MEMORY_ALL_TYPES
AFTER_PUSH = ("kv_cache", "cuda_graph")  # resumed once the push is done
COLOCATED_ORDER = ("training", "push", "rollout")


class IllegalMemoryMove(RuntimeError):
    """A move SGLang would answer by ending the server, or one out of the colocated order."""


@dataclass(frozen=True)
class Moves:
    """What to do next: `release`/`resume` {server index: tags, in `TAGS` order}; `offload`
    {role: parts}; `onload` roles; `empty_cache`: the training processes empty their allocators'
    caches after the offloads and before any resume."""

    release: dict[int, tuple[str, ...]]
    resume: dict[int, tuple[str, ...]]
    offload: dict[str, OffloadParts]
    onload: tuple[str, ...]
    empty_cache: bool


def _parts_minus(planned: OffloadParts, done: OffloadParts) -> OffloadParts:
    return OffloadParts(planned.params and not done.params, planned.grads and not done.grads,
                        planned.optimizer and not done.optimizer)


def _parts_or(a: OffloadParts, b: OffloadParts) -> OffloadParts:
    return OffloadParts(a.params or b.params, a.grads or b.grads, a.optimizer or b.optimizer)


class ColocatedMemory:
    """The states of `servers` rollout servers and of the roles in `offload_plan` (parts they
    offload), and the moves of `COLOCATED_ORDER`. `releases`: the servers release their memory for
    training (`colocation.releases_server_memory`). Servers start with everything resident, roles
    with everything on the device."""

    def __init__(self, servers: int, offload_plan: dict[str, OffloadParts], releases: bool):
        self.releases = releases
        self.plan = dict(offload_plan)
        self.released: list[set[str]] = [set() for _ in range(servers)]  # per server: its released tags
        self.offloaded: dict[str, OffloadParts] = {role: OffloadParts() for role in self.plan}

    # ------------------------------------------------------------------ what to do next
    def _release_all(self) -> dict[int, tuple[str, ...]]:
        """Every server releases what it holds (if `releases`)."""
        if not self.releases:
            return {}
        release = {i: tuple(t for t in TAGS if t not in r) for i, r in enumerate(self.released)}
        return {i: tags for i, tags in release.items() if tags}

    def before_training(self) -> Moves:
        """Every server releases what it holds (if `releases`), then every offloaded role onloads."""
        onload = tuple(role for role, parts in self.offloaded.items() if parts.any())
        return Moves(self._release_all(), {}, {}, onload, False)

    def _offload_the_rest(self) -> dict[str, OffloadParts]:
        """{role: its planned parts still on the device}."""
        offload = {}
        for role, planned in self.plan.items():
            todo = _parts_minus(planned, self.offloaded[role])
            if todo.any():
                offload[role] = todo
        return offload

    def before_restart(self) -> Moves:
        """Before servers start again: every planned part still on the device leaves and the caches
        are emptied, the rollout phase's training memory, which the new servers size theirs from."""
        offload = self._offload_the_rest()
        return Moves({}, {}, offload, (), bool(offload))

    def before_push(self) -> Moves:
        """Servers that hold memory release it (if `releases`: all of them, for a push between
        generations or once a server restarted, unless every server is ready for the push: its
        weights resident and nothing else), the actor comes back if its parameters are off (the
        push reads them), every planned part except the actor's parameters leaves, the caches are
        emptied, then every server whose weights are released resumes them. In the push phase's own
        state (these moves done) it moves nothing: the push asks again before every attempt."""
        ready = all(r == set(AFTER_PUSH) for r in self.released)
        release = {} if ready else self._release_all()
        released = [r | set(release.get(i, ())) for i, r in enumerate(self.released)]
        onload = ("actor",) if "actor" in self.offloaded and self.offloaded["actor"].params else ()
        offload = {}
        for role, planned in self.plan.items():
            keep = OffloadParts(params=True) if role == "actor" else OffloadParts()
            done = OffloadParts() if role in onload else self.offloaded[role]
            todo = _parts_minus(_parts_minus(planned, keep), done)
            if todo.any():
                offload[role] = todo
        resume = {i: ("weights",) for i, r in enumerate(released) if "weights" in r}
        return Moves(release, resume, offload, onload, bool(offload) or bool(resume))

    def flush_before_push(self) -> list[bool]:
        """Per server, whether the push flushes its KV cache first (`/flush_cache`, which needs it
        resident: servers that keep their memory)."""
        return ["kv_cache" not in r for r in self.released]

    def after_push(self) -> Moves:
        """The rest of the plan (the actor's parameters) leaves, the caches are emptied, then the
        servers resume their KV cache and CUDA graphs where released."""
        offload = self._offload_the_rest()
        resume = {i: tuple(t for t in AFTER_PUSH if t in r) for i, r in enumerate(self.released)}
        resume = {i: tags for i, tags in resume.items() if tags}
        return Moves({}, resume, offload, (), bool(offload) or bool(resume))

    # ------------------------------------------------------------------ what was done
    def server_released(self, server: int, tags: tuple[str, ...]) -> None:
        """`server` released `tags` (it was idle: the caller made sure)."""
        self._check_tags(tags)
        self.released[server] |= set(tags)

    def server_resumed(self, server: int, tags: tuple[str, ...]) -> None:
        """`server` resumed `tags`; each must be released (SGLang's KeyError otherwise)."""
        self._check_tags(tags)
        resident = [t for t in tags if t not in self.released[server]]
        if resident:
            raise IllegalMemoryMove(f"rollout server {server}: resuming {resident} that it holds; SGLang 0.5.23 "
                                    f"raises KeyError in its scheduler and the server exits")
        if "weights" not in tags and "weights" in self.released[server] and set(tags) & set(AFTER_PUSH):
            raise IllegalMemoryMove(f"rollout server {server}: resuming {list(tags)} before its weights")
        self.released[server] -= set(tags)

    def server_restarted(self, server: int) -> None:
        """A new process holds all its memory; it must not be resumed."""
        self.released[server] = set()

    def role_offloaded(self, role: str, parts: OffloadParts) -> None:
        self.offloaded[role] = _parts_or(self.offloaded[role], parts)

    def role_onloaded(self, role: str) -> None:
        self.offloaded[role] = OffloadParts()

    def apply(self, moves: Moves) -> None:
        """Record `moves` as done, all of them."""
        for server, tags in moves.release.items():  # the order the trainer carries them out in
            self.server_released(server, tags)
        for role in moves.onload:
            self.role_onloaded(role)
        for role, parts in moves.offload.items():
            self.role_offloaded(role, parts)
        for server, tags in moves.resume.items():
            self.server_resumed(server, tags)

    @staticmethod
    def _check_tags(tags) -> None:
        unknown = set(tags) - set(TAGS)
        if unknown:
            raise IllegalMemoryMove(f"unknown memory tags {sorted(unknown)}; SGLang 0.5.23 has {list(TAGS)}")

    def describe(self) -> str:
        """One line per server and role, for logs and errors."""
        servers = [f"server {i}: " + ",".join(f"{t}={'released' if t in r else 'resident'}" for t in TAGS)
                   for i, r in enumerate(self.released)]
        roles = [f"{role}: " + ",".join(f"{p}={'offloaded' if getattr(parts, p) else 'on device'}"
                                       for p in ("params", "grads", "optimizer"))
                 for role, parts in self.offloaded.items()]
        return "; ".join(servers + roles)

