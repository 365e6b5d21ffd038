"""The controller's handle on generation: rollout servers (one Ray actor each, placed by the plan)
behind the real sglang-router, and the client that drives them.

The fleet serves generation and finds, takes down, restarts and rejoins servers; when to restart
and what comes around it (the colocated memory moves, a new weight sync, a push of the current
weights) is the runtime's (`Cluster.recover`): the fleet calls nothing back. A server whose process
died is taken out of the router (`take_down_failed`), started again at its URL (`restart`), given
the current weights by the runtime, and put back (`rejoin`). A generation that lost prompts to a
dead server raises `GenerationInterrupted` with the answers it has; `generate(partial=)` finishes
it after the restart, sending only the lost prompts (and any answer whose `weight_version` is not
`weight_version`, the last pushed one) again with the same seeds. Each server may restart
`actor_rollout_ref.rollout.max_server_restarts` times over the run; one more death stops the run
with `RolloutServerLost`, naming the server, its node and the tail of its log.

A server whose process runs but does not answer (SIGSTOPped, its HTTP process deadlocked or stuck
in the kernel) is hung, and treated as dead: every `take_down_failed` (and `dead_servers`) asks
each server's `/health` from the driver, and where one does not answer 200 at once (or a server
spans nodes) has each worker ask its server's `/health` and look at its process: one that gives no
HTTP 200 within `HUNG_AFTER_S` is killed by its worker (SIGKILL to its process group), logged as
hung, then restarted as above, counting against `max_server_restarts`. What bounds the time until then: a generation request stuck on it
ends after `actor_rollout_ref.rollout.request_timeout_s` (the client's total timeout per attempt,
retried `max_retries` times, through the router, whose own health checks stop sending it work); a
weight push into it fails within the weight sync's timeouts (`SyncConfig`: one on each server
call, one on each collective of the weight-update group), and the runtime then recovers and
pushes again.

A SGLang server larger than a node runs one process per node (`RolePlacement.server_processes`):
the same command with its node rank, all meeting at `--dist-init-addr` on node 0. Only node 0
serves HTTP, so only its URL goes to the router. One dead node kills the server: all its nodes
restart together.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from megarl.net import free_port
from megarl.placement.gpu_order import GpuOrderError, server_gpu_problems
from megarl.placement.planner import RolePlacement
from megarl.placement.ray_pools import RealisedPools
from megarl.placement.worker_group import WorkerGroup, WorkerGroupError
from megarl.rollout.client import RolloutClient, RolloutRequestError, RolloutResult, stale_reason
from megarl.rollout.control import ServerControl, ServerError, on_each
from megarl.rollout.launch import MultiNode
from megarl.rollout.metrics import summarize
from megarl.rollout.process import exit_description, start_on_a_free_port
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.router import Router
from megarl.runtime.routing import routed_experts_layout
from megarl.workers.rollout_worker import RolloutWorker

log = logging.getLogger("megarl.rollout")


# How long a running server may take to answer `/health` before it counts as hung (seconds). The
# probe must not take a busy server for a hung one. SGLang 0.5.23's `/health` runs a 1-token
# generate by default (waiting for the scheduler, up to SGLANG_HEALTH_CHECK_TIMEOUT=20 s under load,
# impossible with its memory released); megarl starts SGLang with
# SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false (`launch.sglang_env_overrides`), so its `/health`
# answers 200 at once from the HTTP process, however busy the scheduler is (reference:
# sglang-protocol.md, "Health and info"). The CPU engine answers it from its event loop while its
# engine thread generates (503 once that thread died: a broken server, also restarted). A live
# server answers in milliseconds; 10 s leaves room for an HTTP event loop stalled by a large batch's
# (de)tokenisation or a GC pause, and is twice the timeout of sglang-router's own health checks
# (`--health-check-timeout-secs`, 5 s). Such a probe does not reach SGLang's scheduler: a scheduler
# hang behind a live HTTP process ends the run within the request timeouts ("no rollout server died
# or hung") instead of restarting the server.
HUNG_AFTER_S = 10.0

# How long the driver's own `/health` probe of every server waits (seconds) before the fleet asks
# the servers' workers instead (`RolloutFleet._failed_servers`): a live server answers in
# milliseconds (SGLang 0.5.23 from its HTTP process, with no API key, as for `HUNG_AFTER_S` above;
# tests/sglang/test_server_control.py), so an answer within this bound from every server means none
# died or hung; anything else, however slow, is decided by the workers' probe and its `HUNG_AFTER_S`.
QUICK_HEALTH_S = 2.0


class RolloutServerLost(RuntimeError):
    """A rollout server died or hung more often than `max_server_restarts` allows, or did not come back."""


class GenerationInterrupted(RuntimeError):
    """`generate` lost prompts to a dead server: the answers so far, to be passed back as
    `generate(..., partial=)` once the caller has had the server restarted. `samples[i]`,
    `records[i]`: prompt i's (None while it has no answer); `attempts[i]`: requests sent for it so
    far; `started`: when the generation began (`time.monotonic()`), which its metrics count from."""

    def __init__(self, samples: list, records: list, attempts: list[int], lost: dict[int, str], started: float):
        super().__init__(f"{len(lost)} prompt(s) lost to a dead rollout server")
        self.samples, self.records, self.attempts, self.lost = samples, records, attempts, lost
        self.started = started


def multi_node_args(members: list[list[int]], addresses: dict[int, str]) -> list[Optional[MultiNode]]:
    """Per worker rank, its `MultiNode`: `members[i]` are server i's worker ranks, node rank 0
    first; `addresses[head]` the dist-init address its node-0 rank picked. None for a server on
    one node."""
    out: list[Optional[MultiNode]] = [None] * sum(len(ranks) for ranks in members)
    for ranks in members:
        if len(ranks) > 1:
            for node, rank in enumerate(ranks):
                out[rank] = MultiNode(len(ranks), node, addresses[ranks[0]])
    return out


def run_logs_dir(config) -> Path:
    """<trainer.default_local_dir>/<project>/<experiment>/logs, absolute (Ray workers have their own
    working directory): where the servers' and the router's logs go, beside metrics.jsonl."""
    t = config.trainer
    return (Path(t.default_local_dir) / t.project_name / t.experiment_name / "logs").resolve()


def server_log_name(server: int, node: Optional[MultiNode]) -> str:
    """rollout-<server>.log, or rollout-<server>-node<k>.log for node k of a multi-node server."""
    return f"rollout-{server}" + (f"-node{node.node_rank}" if node is not None else "") + ".log"


class RolloutFleet:
    def __init__(self, role: RolePlacement, pools: RealisedPools, config, *, colocated: bool,
                 single_node: bool, api_key: Optional[str] = None, startup_timeout_s: float = 600.0,
                 device: str = "cuda", model_path: Optional[str] = None):
        """`device`: the run's (cuda or cpu), where SGLang serves. `model_path`: the checkpoint the servers
        start from (the FP8 one with rollout.quantization=fp8); None: actor_rollout_ref.model.path."""
        r = config.actor_rollout_ref.rollout
        self.api_key = api_key
        # seconds, each memory release or resume call: SGLang maps a large model's weights back from
        # host memory (--enable-weights-cpu-backup) in seconds to minutes; a hung server fails it then
        self.memory_call_timeout_s = 600.0
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = r.max_server_restarts
        self._versions: list[Optional[str]] = [None]  # every push's version (`weight_version`), in order
        self._faults = {"rollout_server_restarts": 0, "rollout_requests_retried": 0}
        # SGLang runs TP rank j on --base-gpu-id + j: each server's bundles must have got such a run of GPUs
        # (the CPU engine, which uses no GPU, is held to the same rule so that CPU runs meet it too)
        problems = server_gpu_problems(role, [pools.device_gpu(role.pool, i) for i in range(role.world_size)])
        if problems:
            raise GpuOrderError("the rollout servers cannot start on the GPUs Ray gave them:\n"
                                + "\n".join(f"  - {p}" for p in problems))
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if r.name == "sglang" and device == "cuda" else {}
        # each worker owns an independent server process: one's failure does not stop the others' calls
        self.workers = WorkerGroup(RolloutWorker, role, pools, config, colocated=colocated, api_key=api_key,
                                   device=device, env=env, collective=False)
        processes = role.server_processes()  # (server, node rank, first GPU), one per worker rank
        self.server_of = [server for server, _, _ in processes]  # worker rank -> server
        self.members = [[k for k, s in enumerate(self.server_of) if s == i] for i in range(role.dp)]  # node 0 first
        self.router: Optional[Router] = None
        self.client: Optional[RolloutClient] = None  # made once the router runs
        try:
            bind = "127.0.0.1" if single_node else None
            path = model_path or config.actor_rollout_ref.model.path
            logs = run_logs_dir(config)
            try:
                urls = self.workers.call_each(
                    RolloutWorker.start,
                    [(path, bind, startup_timeout_s, str(logs / server_log_name(server, node)), node, server)
                     for server, node in zip(self.server_of, self._multi_node_args())],
                    timeout_s=startup_timeout_s + 60)
            except WorkerGroupError as e:
                raise RolloutServerLost(f"the rollout servers did not start ({self._startup_bound()}): {e}") from None
            self.urls = [urls[ranks[0]] for ranks in self.members]
            # The router runs on the driver's node and listens on loopback: only this client calls it.
            # Its ports were free a moment ago; one bound by another process first: new ports.
            self.router = start_on_a_free_port(
                lambda port: Router(self.urls, port, prometheus_port=free_port("127.0.0.1"), api_key=api_key,
                                    log_path=str(logs / "sglang-router.log"), ready_timeout_s=120), "127.0.0.1")
        except BaseException:
            self.shutdown()
            raise
        self.restarts = [0] * len(self.urls)  # per server, over the run
        self.paused = False  # between a successful `pause_generation` and `continue_generation`
        routes = routed_experts_layout(config)  # (layers, top_k, experts) with routing replay, else None
        self.client = RolloutClient(self.router.url, api_key=api_key, abort_urls=self.urls,
                                    max_concurrency=r.max_concurrent_requests, request_timeout_s=r.request_timeout_s,
                                    continue_aborted=config.async_training.partial_rollout,
                                    routed_experts=routes,
                                    server_urls=self.urls if routes or r.batch_requests_per_server else None,
                                    batch_per_server=r.batch_requests_per_server)

    @property
    def weight_version(self) -> Optional[str]:
        """The last push's version (None: nothing pushed yet); kept samples carry it, or one pushed
        during their generation (partial rollouts)."""
        return self._versions[-1]

    @weight_version.setter
    def weight_version(self, version: Optional[str]) -> None:
        self._versions.append(version)

    def _multi_node_args(self) -> list[Optional[MultiNode]]:
        """Per worker rank: its `MultiNode` (None for a server within one node); the node-0 actor
        of each multi-node server picks the address its nodes meet at."""
        heads = [ranks[0] for ranks in self.members if len(ranks) > 1]
        addresses = self.workers.call_ranks(heads, RolloutWorker.dist_init_address, timeout_s=60) if heads else []
        return multi_node_args(self.members, dict(zip(heads, addresses)))

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 seeds: Optional[list[int]] = None, *, partial: Optional[GenerationInterrupted] = None) -> RolloutResult:
        """`sampling.n` samples per prompt, all from live servers at `weight_version`. `seeds`:
        per-prompt sampling seeds (see RolloutClient.agenerate); a prompt sent again keeps its seed.
        Records count every attempt a prompt took, over the client's retries and the fleet's.
        Nothing is restarted here (the runtime restarts servers where nothing generates:
        `Cluster.generate`, the push): prompts lost to a dead server (or one restarted meanwhile)
        raise `GenerationInterrupted`, and `partial=` that error finishes the same prompts later,
        sending only the lost ones (answers kept carry their version). Prompts lost while every
        server lives and none restarted raise `RolloutRequestError` (a retry would repeat it)."""
        started = partial.started if partial else time.monotonic()
        since, restarts = len(self._versions) - 1, sum(self.restarts)
        n = len(prompts)
        samples: list = list(partial.samples) if partial else [None] * n
        records: list = list(partial.records) if partial else [None] * n
        attempts = list(partial.attempts) if partial else [0] * n
        todo = [i for i in range(n) if samples[i] is None]
        if todo:
            part = self.client.generate([prompts[i] for i in todo], sampling,
                                        seeds=[seeds[i] for i in todo] if seeds is not None else None,
                                        keep_going=True)
            lost = {}
            for j, i in enumerate(todo):
                attempts[i] += part.records[j].attempts
                # answers from the weights current at the start, or pushed since (partial rollouts)
                why = part.failed.get(j) or stale_reason(part.samples[j], self.weight_version, self._versions[since:-1])
                if why is None:
                    samples[i], records[i] = part.samples[j], part.records[j]
                else:
                    lost[i] = why
            if lost:
                log.warning("%d of %d prompts got no usable answer (e.g. prompt %d: %s)", len(lost), len(todo),
                            *next(iter(lost.items())))
                if not self.dead_servers() and sum(self.restarts) == restarts:
                    index, why = next(iter(lost.items()))
                    raise RolloutRequestError(index, None, f"{why} (and no rollout server died or hung)")
                raise GenerationInterrupted(samples, records, attempts, lost, started)
        records = [replace(r, attempts=a) for r, a in zip(records, attempts)]
        metrics = summarize(records, time.monotonic() - started)
        self._faults["rollout_requests_retried"] += metrics.retried_requests
        return RolloutResult(samples, metrics, records)

    def dead_servers(self) -> list[int]:
        """The servers whose process died or that hung (asks each worker, which probes `/health`
        for at most `HUNG_AFTER_S`; kills and restarts nothing)."""
        return sorted(self._failed_servers()[0])

    def _failed_servers(self) -> tuple[dict[int, int], list[dict]]:
        """(server -> the worker rank of its first process that died or hung, every worker's
        status). At once ({}, []) when every server is one process and answers `/health` to the
        driver within `QUICK_HEALTH_S`: one HTTP call per server, no call to the workers (a
        multi-node server's other nodes serve no HTTP: only their workers see them)."""
        if all(len(ranks) == 1 for ranks in self.members) and all(
                answered is True for answered in on_each(self.servers(), lambda s: s.health(QUICK_HEALTH_S))):
            return {}, []
        statuses = self._statuses()
        return self._failed(statuses), statuses

    def _statuses(self) -> list[dict]:
        """Every worker's `status`, with its server's `/health` probed (at once on all workers)."""
        return self.workers.call(RolloutWorker.status, HUNG_AFTER_S, timeout_s=60 + 2 * HUNG_AFTER_S)

    def _failed(self, statuses: list[dict]) -> dict[int, int]:
        """server -> the worker rank of its first process that died or hung (did not answer `/health`)."""
        failed: dict[int, int] = {}
        for k, status in enumerate(statuses):
            if not status["running"] or status["answers"] is False:
                failed.setdefault(self.server_of[k], k)
        return failed

    def take_down_failed(self) -> list[int]:
        """The servers whose process died or that hung (alive, but no answer to `/health` within
        `HUNG_AFTER_S`: their worker kills them), each taken out of the router and counted as a
        restart; [] when every server answers. Call it only while no generation runs. Raises
        `RolloutServerLost` for a server past `max_server_restarts` (every hung one is killed first)."""
        failed, statuses = self._failed_servers()
        dead = sorted(failed)
        for i in dead:  # every hung server is killed, also when the run stops below: none is left stopped
            k = failed[i]
            if statuses[k]["running"]:
                self._kill_hung(i, k, statuses[k])
        for i in dead:
            k = failed[i]
            if self.restarts[i] >= self.max_restarts:
                raise RolloutServerLost(self._lost_message(i, k, statuses[k]))
            log.warning("rollout server %d at %s: its process on %s %s; restart %d of at most %d", i,
                        self.urls[i], self.workers.locations[k], self._what_happened(statuses[k]),
                        self.restarts[i] + 1, self.max_restarts)
        registered = set(self.router.worker_urls()) if dead else set()
        for i in dead:
            if self.urls[i] in registered:
                self.router.remove_worker(self.urls[i])
            self.restarts[i] += 1
        self._faults["rollout_server_restarts"] += len(dead)
        return dead

    def restart(self, servers: list[int]) -> None:
        """Start `servers` (taken down) again at their URLs, every node of each; they stay out of the
        router until `rejoin`. Raises `RolloutServerLost` when one does not come back."""
        try:
            self.workers.call_ranks([k for i in servers for k in self.members[i]], RolloutWorker.restart,
                                    timeout_s=self.startup_timeout_s + 60)
        except WorkerGroupError as e:
            urls = [self.urls[i] for i in servers]
            raise RolloutServerLost(f"restarting rollout server(s) {urls} failed ({self._startup_bound()}): {e}") from None

    def rejoin(self, servers: list[int]) -> None:
        """Restarted `servers` (at the current weights) back in the router; inside a push's pause
        (partial rollouts) paused too, so the requests sent again wait there until the continue."""
        for i in servers:
            if self.paused:
                self.servers()[i].pause_generation("abort")
            self.router.add_worker(self.urls[i], timeout_s=120)

    def _startup_bound(self) -> str:
        return (f"each may take actor_rollout_ref.rollout.server_startup_timeout_s={self.startup_timeout_s:g} s to "
                "answer /health; raise it for a large checkpoint on a slow filesystem")

    def _kill_hung(self, i: int, rank: int, status: dict) -> None:
        """Server `i`'s process on worker `rank` runs but did not answer `/health`: its worker kills
        its process group (SIGKILL) and reaps it."""
        log.warning("rollout server %d at %s: its process on %s (pid %d) is hung: alive, but no answer to /health "
                    "within %.1f s; killing it (SIGKILL to its process group)", i, self.urls[i],
                    self.workers.locations[rank], status["pid"], status["probe_s"])
        try:
            self.workers.call_ranks([rank], RolloutWorker.kill,
                                    f"hung: no answer to /health within {status['probe_s']:.1f} s", timeout_s=60)
        except WorkerGroupError as e:
            raise RolloutServerLost(f"rollout server {i} at {self.urls[i]} on node {self.workers.locations[rank]} "
                                    f"hung and could not be killed: {e}") from None

    @staticmethod
    def _what_happened(status: dict) -> str:
        """'died (killed by SIGKILL)', or for a hung server 'hung (alive, but no answer ...; killed)'."""
        if status["running"]:  # as it was at the probe; the fleet has killed it since
            return (f"hung (alive, but no answer to /health within {status['probe_s']:.1f} s; killed with "
                    f"SIGKILL to its process group)")
        return f"died ({exit_description(status['exit_code'])})"

    def _lost_message(self, i: int, rank: int, status: dict) -> str:
        """Server `i` is lost; worker `rank` is (one of) its dead or hung process(es)."""
        tail = self.workers.call_ranks([rank], RolloutWorker.log_tail, 30, timeout_s=60)[0]
        return (f"rollout server {i} at {self.urls[i]} on node {self.workers.locations[rank]} ({status['ip']}, host "
                f"{status['hostname']}) {self._what_happened(status)} after {self.restarts[i]} "
                f"restart(s); actor_rollout_ref.rollout.max_server_restarts={self.max_restarts} allows no more, so "
                f"the run stops. Last lines of its log {status['log_path']}:\n{tail}")

    def fault_metrics(self) -> dict[str, float]:
        """`faults/rollout_server_restarts` and `faults/rollout_requests_retried` (requests sent
        more than once, by the client or the fleet) since the last call; the counters restart."""
        out = {f"faults/{k}": float(v) for k, v in self._faults.items()}
        self._faults = dict.fromkeys(self._faults, 0)
        return out

    def servers(self) -> list[ServerControl]:
        return [ServerControl(url, self.api_key) for url in self.urls]

    def pause_generation(self) -> bool:
        """Partial rollouts, before a push: every server aborts its running requests (the client
        sends them on, to wait at the server) and holds new ones until `continue_generation`.
        Returns False, with the servers it had paused continued again, when one cannot be reached
        because its process died (after the caller's check): the push must then wait for the
        generation, which the dead server cuts short, and restart it first, as without partial
        rollouts. An unreachable server still alive raises."""
        paused = []
        for server in self.servers():
            try:
                server.pause_generation("abort")
            except ServerError:
                if not self.dead_servers():
                    raise
                log.warning("rollout server %s died before the push could pause it: the push waits for the "
                            "generation in flight instead, and restarts the server", server.url)
                for other in paused:
                    other.continue_generation()
                return False
            paused.append(server)
        self.paused = True
        return True

    def continue_generation(self) -> None:
        for server in self.servers():
            server.continue_generation()
        self.paused = False

    def release_memory(self, tags: dict[int, tuple[str, ...]]) -> dict[int, str]:
        """Colocated: server i frees its memory `tags[i]` (SGLang's tags; the caller's
        `placement.colocated_memory` decides which), all at once, each once it is idle (SGLang
        0.5.23 asserts that, and its server ends otherwise: `ServerControl.release_memory_when_idle`).
        Returns {server: error} of the calls that failed (a dead or hung server: the runtime restarts
        it; one busy past the wait); the others released."""
        return self._memory_calls(tags, lambda server, t: server.release_memory_when_idle(t))

    def resume_memory(self, tags: dict[int, tuple[str, ...]]) -> dict[int, str]:
        """Colocated: server i takes its memory `tags[i]` back (each released before: SGLang 0.5.23
        ends a server asked to resume what it holds), all at once. Returns {server: error} of the
        calls that failed; the others resumed."""
        return self._memory_calls(tags, lambda server, t: server.resume_memory_occupation(t))

    def _memory_calls(self, tags: dict[int, tuple[str, ...]], call) -> dict[int, str]:
        """`call(server i, list(tags[i]))` on every server in `tags` at once, each bounded by
        `memory_call_timeout_s`; {server: error} of those that failed."""
        servers = [ServerControl(self.urls[i], self.api_key, timeout_s=self.memory_call_timeout_s) for i in tags]
        results = on_each(servers, lambda server: call(server, list(tags[self.urls.index(server.url)])))
        return {i: f"rollout server {i}: {r}" for i, r in zip(tags, results) if isinstance(r, ServerError)}

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.workers.actors:
            try:
                self.workers.call(RolloutWorker.stop, timeout_s=60)
            finally:
                self.workers.shutdown()
