"""Colocated memory around rollout server restarts (issue 49, finding 4), as the order of the
cluster's calls. SGLang sizes a server's KV cache from the device memory free when it starts, so a
server restarted while the training engines hold their states gets a tiny cache or none ("Not
enough memory"); and the actor onloaded beside servers that hold their weights, KV cache and CUDA
graphs needs more memory than either phase of the step has.

The real `Cluster` (its __init__, memory state machine, pushes and recoveries) and the real
`RolloutFleet` restart steps run against stand-ins for the processes: engines that record offload,
onload, empty_cache and the push, servers that record release, resume and restart, each as SGLang
0.5.23 and megatron hold memory. The check is written from those calls alone, not from
`placement.colocated_memory`: a server (re)starts only when every planned part is off the device
and every training process emptied its cache after its last offload (the rollout phase's memory),
a role onloads only while no server holds memory, nothing is resumed that was not released
(SGLang's KeyError), and a push finds every server with its weights resident and its KV
cache and CUDA graphs released. No Ray, no process: a second per test."""
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import load_and_validate
from megarl.rollout.control import ServerError
from megarl.runtime import cluster as cluster_module
from megarl.runtime.cluster import Cluster
from megarl.runtime.rollout_fleet import RolloutFleet
from megarl.workers.rollout_worker import RolloutWorker

REPO = Path(__file__).resolve().parents[2]
SERVERS = 2
ALL_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})
ALL_PARTS = frozenset({"params", "grads", "optimizer"})
# what the config below offloads while generating (placement.colocation: the reference has parameters only)
PLANNED = {"actor": ALL_PARTS, "ref": frozenset({"params"})}
CONFIG = ("actor_rollout_ref.model.path=/nonexistent", "data.train_files=[/nonexistent.parquet]", "data.val_files=[]",
          "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.use_kl_loss=true",
          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
          "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
          "actor_rollout_ref.rollout.weight_sync_transport=distributed",
          "actor_rollout_ref.rollout.max_server_restarts=4",
          "actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
          "actor_rollout_ref.actor.megatron.optimizer_offload=true",
          "actor_rollout_ref.ref.megatron.param_offload=true")


class World:
    """The colocated GPUs' occupants, kept from the calls alone: per server the memory tags it holds
    (a new process holds all), per role the parts on the device; every call in order (`events`),
    and every call made in a state it must not be made in (`problems`)."""

    def __init__(self):
        self.events: list[tuple] = []
        self.problems: list[str] = []
        self.held = [set(ALL_TAGS) for _ in range(SERVERS)]  # servers start holding everything
        self.on_device: dict[str, set] = {}
        self.emptied: set[str] = set()  # roles whose cache was emptied since the last offload of any role
        self.dead: set[int] = set()
        self.dies_at_next_push: int | None = None  # a server that dies as the next push starts
        self.version = 0

    def problem(self, what: str) -> None:
        self.problems.append(f"{what} (after {self.events[-6:]})")

    def server_start(self, server: int) -> None:
        self.events.append(("restart", server) if self.on_device else ("start", server))
        left = {role: sorted(self.on_device[role] & PLANNED[role]) for role in PLANNED if role in self.on_device}
        left = {role: parts for role, parts in left.items() if parts}
        if left:
            self.problem(f"server {server} started with {left} on the device: it sizes its KV cache from less "
                         "than the trainer leaves free while generating")
        if self.on_device and self.emptied != set(self.on_device):
            self.problem(f"server {server} started before every training process emptied its cache "
                         f"(emptied: {sorted(self.emptied)})")
        self.held[server] = set(ALL_TAGS)
        self.dead.discard(server)

    def release(self, server: int, tags) -> None:
        self.events.append(("release", server, tuple(sorted(tags))))
        self.held[server] -= set(tags)

    def resume(self, server: int, tags) -> None:
        self.events.append(("resume", server, tuple(sorted(tags))))
        resident = set(tags) & self.held[server]
        if resident:
            self.problem(f"server {server} resumed {sorted(resident)} that it holds: SGLang's KeyError ends it")
        self.held[server] |= set(tags)

    def onload(self, role: str) -> None:
        self.events.append(("onload", role))
        holding = {i: sorted(tags) for i, tags in enumerate(self.held) if tags}
        if holding:
            self.problem(f"{role} onloaded while servers hold memory {holding}")
        self.on_device[role] = set(ALL_PARTS) if role == "actor" else {"params"}

    def offload(self, role: str, parts: set) -> None:
        self.events.append(("offload", role, tuple(sorted(parts))))
        self.on_device[role] -= parts
        self.emptied = set()

    def empty_cache(self, role: str) -> None:
        self.events.append(("empty_cache", role))
        self.emptied.add(role)

    def push(self, version) -> int:
        self.version = self.version + 1 if version is None else version
        self.events.append(("push", self.version))
        if "params" not in self.on_device["actor"]:
            self.problem("the push read the actor's parameters off the device")
        for i, tags in enumerate(self.held):
            if "weights" not in tags or tags & {"kv_cache", "cuda_graph"}:
                self.problem(f"the push found server {i} holding {sorted(tags)}: weights only is the push's phase")
        return self.version


class FakePools:
    def remove(self) -> None:
        pass


class FakeRole:
    """A training role's handle: its states on the device from its start (megatron)."""

    def __init__(self, role, pools, config, devices, world: World):
        self.name, self.world = role.name, world
        world.events.append(("init", self.name))
        world.on_device[self.name] = set(ALL_PARTS) if self.name == "actor" else {"params"}

    def offload(self, params: bool, grads: bool, optimizer: bool) -> list[dict]:
        asked = dict(params=params, grads=grads, optimizer=optimizer)
        self.world.offload(self.name, {part for part, on in asked.items() if on})
        return [{"seconds": 0.0, "bytes": 0, "freed_bytes": 0}]

    def onload(self) -> list[dict]:
        self.world.onload(self.name)
        return [{"seconds": 0.0, "bytes": 0}]

    def empty_cache(self) -> list[dict]:
        self.world.empty_cache(self.name)
        return [{"reserved_before": 0, "reserved_after": 0}]

    def init_weight_sync(self, urls, sync_config, version, api_key) -> None:
        self.world.events.append(("sync",))

    def push_weights(self, version, flush) -> dict:
        """The weight sync: every server must answer (a dead one fails the push, `ServerError`)."""
        if self.world.dies_at_next_push is not None:
            self.world.dead.add(self.world.dies_at_next_push)
            self.world.dies_at_next_push = None
        if self.world.dead:
            self.world.events.append(("push_failed", sorted(self.world.dead)))
            raise ServerError(f"rollout servers {sorted(self.world.dead)} did not answer")
        return {"sync/weight_version": float(self.world.push(version))}

    def shutdown(self) -> None:
        pass


class FakeWorkers:
    """The fleet's worker group: only the restart call reaches it here."""

    def __init__(self, world: World):
        self.world = world
        self.locations = ["node-0"] * SERVERS

    def call_ranks(self, ranks, method, *args, timeout_s):
        assert method is RolloutWorker.restart, method
        for rank in ranks:
            self.world.server_start(rank)


class FakeRouter:
    def worker_urls(self):
        return []

    def add_worker(self, url, timeout_s):
        pass


class FakeFleet(RolloutFleet):
    """The real restart steps (and the rest of `RolloutFleet`) over stand-in server processes."""

    def __init__(self, role, pools, config, *, world: World, **_):
        self.world = world
        self.api_key, self.max_restarts, self.paused = None, config.actor_rollout_ref.rollout.max_server_restarts, False
        self.urls = [f"http://server-{i}" for i in range(SERVERS)]
        self.server_of, self.members = list(range(SERVERS)), [[i] for i in range(SERVERS)]
        self.restarts = [0] * SERVERS
        self._versions, self._faults = [None], {"rollout_server_restarts": 0, "rollout_requests_retried": 0}
        self.workers, self.router, self.client = FakeWorkers(world), FakeRouter(), SimpleNamespace(lora_name=None)
        self.startup_timeout_s = 60.0
        for i in range(SERVERS):
            world.server_start(i)

    def _statuses(self) -> list[dict]:
        return [{"running": i not in self.world.dead, "answers": i not in self.world.dead, "exit_code": -9}
                for i in range(SERVERS)]

    def release_memory(self, tags):
        return self._memory_calls(tags, self.world.release)

    def resume_memory(self, tags):
        return self._memory_calls(tags, self.world.resume)

    def _memory_calls(self, tags, call):
        failed = {}
        for server, server_tags in tags.items():
            if server in self.world.dead:
                failed[server] = f"rollout server {server}: connection refused"
            else:
                call(server, server_tags)
        return failed

    def shutdown(self) -> None:
        pass


@pytest.fixture
def cluster(monkeypatch):
    """A colocated cluster of two servers, the actor and the reference model offloading as
    `PLANNED`, past its start (servers released, engines up, version 0 pushed, roles offloaded,
    KV caches back): the rollout phase. `cluster.world` holds what the calls did."""
    world = World()
    monkeypatch.setattr(cluster_module, "create_pools", lambda plan, timeout_s: FakePools())
    monkeypatch.setattr(cluster_module, "RolloutFleet", lambda *a, **kw: FakeFleet(*a, world=world, **kw))
    monkeypatch.setattr(cluster_module, "ActorRole", lambda *a: FakeRole(*a, world=world))
    monkeypatch.setattr(cluster_module, "RefRole", lambda *a: FakeRole(*a, world=world))
    config = load_and_validate(str(REPO / "configs/tiny/grpo.yaml"), list(CONFIG))
    c = Cluster(config)
    c.world = world
    assert world.problems == []
    assert world.held == [set(ALL_TAGS)] * SERVERS and world.on_device == {"actor": set(), "ref": set()}
    yield c
    c.shutdown()


def rollout_phase(world: World) -> None:
    """Every server holds all its memory, every planned part is off the device, no problem met."""
    assert world.problems == [], "\n".join(world.problems)
    assert world.held == [set(ALL_TAGS)] * SERVERS and world.on_device == {"actor": set(), "ref": set()}
    assert not world.dead


def test_a_server_that_died_while_training_restarts_once_the_engines_offloaded(cluster):
    """The push's recovery restarted the server first, while the engines held every state."""
    world = cluster.world
    cluster.training_phase()
    world.dead.add(1)
    world.events.clear()
    cluster.sync_weights()
    rollout_phase(world)
    restart = world.events.index(("restart", 1))
    assert ("offload", "actor", ("grads", "optimizer", "params")) in world.events[:restart]
    assert world.events[restart - 2:restart] == [("empty_cache", "actor"), ("empty_cache", "ref")]
    # the push after the restart: the new server releases what it holds before the actor comes back
    assert world.events[restart + 1:restart + 4] == [("sync",), ("release", 1, tuple(sorted(ALL_TAGS))),
                                                     ("onload", "actor")]
    assert world.version == 1


def test_a_restart_at_generation_start_pushes_again_with_the_servers_memory_released(cluster):
    """The generation's first step (`Cluster.generate` runs `recover`) found server 0 dead: restarted in
    the rollout phase, then the weights pushed again at the current version, the actor onloaded
    beside servers holding weights, KV cache and CUDA graphs."""
    world = cluster.world
    world.dead.add(0)
    world.events.clear()
    assert cluster.recover() == 1
    rollout_phase(world)
    assert world.events[0] == ("restart", 0)
    onload = world.events.index(("onload", "actor"))
    released = {e[1] for e in world.events[:onload] if e[0] == "release"}
    assert released == {0, 1}
    assert [e for e in world.events if e[0] == "push"] == [("push", 0)]  # the current version again


def test_a_restart_before_training_leaves_the_weights_to_the_steps_push(cluster):
    """`training_phase` found server 1 dead: restarted in the rollout phase, released with the
    others; the actor onloads with every server released; the step's push gives it the weights."""
    world = cluster.world
    world.dead.add(1)
    world.events.clear()
    cluster.training_phase()
    assert world.problems == [], "\n".join(world.problems)
    assert world.events[0] == ("restart", 1)
    assert world.held == [set(), set()] and world.on_device == {"actor": set(ALL_PARTS), "ref": {"params"}}
    cluster.sync_weights()
    rollout_phase(world)
    assert [e for e in world.events if e[0] == "push"] == [("push", 1)]


def test_a_server_dying_during_the_push_restarts_once_the_actor_offloaded_its_parameters(cluster):
    """The push's first try fails on a dead server with the actor's parameters on the device and
    the other server's weights resumed: the restart waits for the actor's parameters to leave, and
    the second try onloads the actor only once both servers released what they hold."""
    world = cluster.world
    cluster.training_phase()
    world.dies_at_next_push = 1
    world.events.clear()
    cluster.sync_weights()
    rollout_phase(world)
    failed = world.events.index(("push_failed", [1]))
    restart = world.events.index(("restart", 1))
    assert ("offload", "actor", ("params",)) in world.events[failed:restart]
    assert [e for e in world.events if e[0] == "push"] == [("push", 1)]
