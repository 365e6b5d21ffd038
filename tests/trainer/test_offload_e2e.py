"""Colocated offload end to end on CPU: configs/tiny/grpo.yaml on one logical GPU (TP=1 actor, a
reference model for the KL loss, one colocated CPU-engine server; offloading is per rank, so more
ranks add nothing here but CI time) for 2 steps with the actor's parameters, gradients
and optimizer state and the reference model's parameters offloaded while generating, against the
same run with offload off, the servers keeping their memory (`rollout.free_cache_engine=false`,
as the CPU quickstart runs) and the old log-probs made by a separate pass before the update
(`actor.old_log_probs_in_update=false`; the offload run's update makes them itself).

Checked: the servers start and release their memory before any engine initialises; every step
runs the colocated order of `placement.colocated_memory` (generate, release, onload, compute,
update; then the gradients, optimizer state and reference parameters offloaded, every training
process's cache emptied, the servers' weights resumed, the push, the actor's parameters offloaded,
the caches emptied again, the KV cache resumed; a checkpoint the same around its save), and a
ledger of the logical GPU, kept from the bytes each offload reports, holds at each server resume
exactly what that phase of the memory estimate keeps: the actor's parameters before the weights
come back, no training state before the KV cache does; the run is
bit-identical to the other (metrics and weights; one mini-batch per step, whose log-probs the
update takes from its own forward); the bytes a step reports equal the
sizes of the storages each key names, counted on the engines' own tensors; `megarl plan`'s
estimate offloads exactly the roles the trainer offloads. Without `free_cache_engine` no server
releases or resumes anything, at start or in a step, and the run is still the same.
"""
import os
import signal
import time

import pytest
import ray
import torch

from megarl.bridge import arch_from_hf_config, load_hf_config
from megarl.placement.memory import estimate
from megarl.rollout.control import ServerControl
from megarl.runtime import cluster as cluster_module
from megarl.runtime.engine_group import EngineGroup
from megarl.runtime.roles import ActorRole, TrainingRole
from megarl.runtime.rollout_fleet import RolloutFleet
from megarl.workers.rollout_worker import RolloutWorker

pytestmark = pytest.mark.slow

STEPS = 2
OFFLOAD = ("actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true", "actor_rollout_ref.ref.megatron.param_offload=true")
# The reference model's layout is set in both runs: a `ref.megatron` section with any key set
# (param_offload) no longer inherits the actor's (config/validate.py).
WITH_REF = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
            "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1")
SERVERS = 1  # one colocated server per logical GPU
KEEP_MEMORY = "actor_rollout_ref.rollout.free_cache_engine=false"  # the offload-off run's servers keep theirs
SEPARATE_OLD_LOG_PROBS = "actor_rollout_ref.actor.old_log_probs_in_update=false"  # the offload-off run's
# Metrics that measure time, not the computation; and the servers' log-probs against the actor's
# (`training/rollout_*`): the CPU engine's numbers move in the last bits with how it batched the
# concurrent requests, which timing decides (the sampled tokens do not).
TIMED = ("timing/", "throughput/", "perf/", "sync/seconds", "sync/gb_per_s", "sync/prepare_s", "sync/commit_s",
         "sync/check_s", "sync/slowest", "rollout/wall_s", "rollout/longest_sample_s", "rollout/tokens_per_s",
         "rollout/latency", "training/rollout_")


class Recorder:
    """The order of the cluster's calls, recorded by the engine-group and fleet classes below."""

    events: list = []
    fleets: list = []

    @classmethod
    def server_memory(cls) -> list[list[str]]:
        """Each started server's released memory tags, as the server reports them."""
        return [ServerControl(url, fleet.api_key).server_info()["internal_states"][0]["released_memory"]
                for fleet in cls.fleets for url in fleet.urls]


# what `record_training_roles` wraps, as defined (a second run in one test wraps these again, not its wrappers)
UNRECORDED = {(cls, name): getattr(cls, name) for cls, names in (
    (EngineGroup, ("__init__", "compute", "update", "update_and_compute")),
    (TrainingRole, ("offload", "onload", "empty_cache")), (ActorRole, ("push_weights",))) for name in names}


def record_training_roles(monkeypatch) -> None:
    """Record the training roles' calls in `Recorder.events`: patched over `EngineGroup`, which
    every role's handle runs through, and the handles' memory moves and push."""
    def before(method, event):
        def recording(self, *args, **kwargs):
            Recorder.events.append((event, self.name))
            return method(self, *args, **kwargs)
        return recording

    def after(method, event):
        def recording(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            Recorder.events.append((event, self.name))
            return result
        return recording

    init, offload = UNRECORDED[EngineGroup, "__init__"], UNRECORDED[TrainingRole, "offload"]

    def recording_init(self, role, pools, config, *args, **kwargs):
        Recorder.events.append(("init", role.name, Recorder.server_memory()))
        init(self, role, pools, config, *args, **kwargs)

    def recording_offload(self, params, grads, optimizer):
        result = offload(self, params, grads, optimizer)
        # the parts asked and the device bytes each part freed, summed over ranks
        asked = dict(params=params, grads=grads, optimizer=optimizer)
        Recorder.events.append(("offload", self.name, tuple(p for p in asked if asked[p]),
                                {p: sum(r[f"{p}_bytes"] for r in result) for p in asked}))
        return result

    monkeypatch.setattr(EngineGroup, "__init__", recording_init)
    for name in ("compute", "update", "update_and_compute"):
        monkeypatch.setattr(EngineGroup, name, before(UNRECORDED[EngineGroup, name], name))
    monkeypatch.setattr(ActorRole, "push_weights", before(UNRECORDED[ActorRole, "push_weights"], "push"))
    monkeypatch.setattr(TrainingRole, "offload", recording_offload)
    for name in ("onload", "empty_cache"):
        monkeypatch.setattr(TrainingRole, name, after(UNRECORDED[TrainingRole, name], name))


class RecordingFleet(RolloutFleet):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Recorder.fleets.append(self)
        Recorder.events.append(("servers_started",))

    def generate(self, *args, **kwargs):
        Recorder.events.append(("generate",))
        return super().generate(*args, **kwargs)

    def release_memory(self, tags):
        Recorder.events.append(("release", tags))
        return super().release_memory(tags)

    def resume_memory(self, tags):
        Recorder.events.append(("resume", tags))
        return super().resume_memory(tags)


def _state_bytes(worker) -> dict:
    """This rank's parameter, gradient-buffer and optimizer-state bytes, counted on the engine's
    tensors (each distinct storage once; the three sets must not overlap)."""
    engine = worker.engine

    def storages(tensors):
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    params = storages(p for chunk in engine.model_chunks for p in chunk.parameters())
    grads, state = {}, {}
    if engine.optimizer is not None:
        grads = storages(b.grad_data for chunk in engine._ddp_chunks for b in chunk.buffers)
        state = storages(t for s in engine.optimizer.optimizer.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor))
        state = {ptr: n for ptr, n in state.items() if ptr not in params}  # fp32: the optimizer's params are the model's
    assert not (params.keys() & grads.keys()) and not (grads.keys() & state.keys())
    assert all(params.values()), "a parameter storage is empty: the engine is offloaded"
    numel_bytes = sum(p.numel() * p.element_size() for chunk in engine.model_chunks for p in chunk.parameters())
    return {"params": sum(params.values()), "grads": sum(grads.values()), "optimizer": sum(state.values()),
            "numel_bytes": numel_bytes}


def _weights(worker) -> list:
    return [p.detach().clone() for chunk in worker.engine.model_chunks for p in chunk.parameters()]


def _run(tiny_assets, out_dir, tiny_grpo_cluster, monkeypatch, *overrides, restart: bool = False) -> dict:
    record_training_roles(monkeypatch)
    monkeypatch.setattr(cluster_module, "RolloutFleet", RecordingFleet)
    Recorder.events, Recorder.fleets = [], []
    result = {}
    with tiny_grpo_cluster(tiny_assets, out_dir, *WITH_REF, *overrides) as (cluster, trainer):
        result["start"] = list(Recorder.events)
        steps = []
        for _ in range(STEPS):
            Recorder.events.clear()
            metrics = trainer.train_step()
            trainer.step += 1
            steps.append((list(Recorder.events), metrics))
        result["steps"] = steps
        Recorder.events.clear()
        saved = trainer.save_checkpoint()
        result["save"] = (list(Recorder.events), (saved / "actor").is_dir(),
                          [ServerControl(url, cluster.rollout.api_key).weight_version() for url in cluster.rollout.urls])
        cluster.training_phase()  # the engines back on their devices, to be read
        result["actor_bytes"] = ray.get([a.__ray_call__.remote(_state_bytes) for a in cluster.actor.workers.actors])
        result["ref_bytes"] = ray.get([a.__ray_call__.remote(_state_bytes) for a in cluster.ref.workers.actors])
        result["weights"] = ray.get([a.__ray_call__.remote(_weights) for a in cluster.actor.workers.actors])
        if restart:  # the server killed between steps: restarted, it holds all its memory, never resumed
            cluster._push(version=cluster.weight_version)  # the servers back in generation's state
            status = cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[0]
            os.kill(status["pid"], signal.SIGKILL)
            while cluster.rollout.workers.call(RolloutWorker.status, timeout_s=30)[0]["running"]:
                time.sleep(0.05)
            Recorder.events.clear()
            metrics = trainer.train_step()
            result["restart_step"] = (list(Recorder.events), metrics)
        result["config"], result["plan"] = cluster.config, cluster.plan
    return result


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory, tiny_grpo_cluster, ray_two_gpus):
    with pytest.MonkeyPatch.context() as monkeypatch:
        on = _run(tiny_assets, tmp_path_factory.mktemp("on"), tiny_grpo_cluster, monkeypatch, *OFFLOAD, restart=True)
        off = _run(tiny_assets, tmp_path_factory.mktemp("off"), tiny_grpo_cluster, monkeypatch, KEEP_MEMORY,
                   SEPARATE_OLD_LOG_PROBS)
    return on, off


ALL_TAGS = ("weights", "kv_cache", "cuda_graph")
# the push's memory moves (placement.colocated_memory): the states the push does not read leave, the
# caches are emptied, the weights come back; after the push the actor's parameters leave too, the
# caches are emptied again, and the KV cache comes back
AROUND_THE_PUSH = [("offload", "actor", ("grads", "optimizer")), ("offload", "ref", ("params",)),
                   ("empty_cache", "actor"), ("empty_cache", "ref"), ("resume", {0: ("weights",)}), ("push", "actor"),
                   ("offload", "actor", ("params",)), ("empty_cache", "actor"), ("empty_cache", "ref"),
                   ("resume", {0: ("kv_cache", "cuda_graph")})]


def compact(events) -> list:
    """The events without their byte counts."""
    return [e[:3] if e[0] == "offload" else e for e in events]


def test_servers_release_their_memory_before_the_engines_initialise(runs):
    on, _ = runs
    start = compact(on["start"])
    assert start[0] == ("servers_started",) and start[1] == ("release", {0: ALL_TAGS})
    inits = [e for e in start if e[0] == "init"]
    assert [e[1] for e in inits] == ["actor", "ref"]
    for _, role, memory in inits:
        assert memory == [["cuda_graph", "kv_cache", "weights"]] * SERVERS, (role, memory)
    # then the first push (the servers' weights back) with the planned offloads around it
    assert start[len(start) - len(AROUND_THE_PUSH):] == AROUND_THE_PUSH


def test_servers_that_keep_their_memory_are_never_released(runs):
    _, off = runs
    start = off["start"]
    assert start[0] == ("servers_started",) and not [e for e in start if e[0] in ("release", "resume")]
    inits = [e for e in start if e[0] == "init"]
    assert [e[1] for e in inits] == ["actor", "ref"]
    for _, role, memory in inits:
        assert memory == [[]] * SERVERS, (role, memory)
    assert start[-1] == ("push", "actor")


def test_every_step_follows_the_colocated_order(runs):
    on, off = runs
    expected = [("generate",), ("release", {0: ALL_TAGS}), ("onload", "actor"), ("onload", "ref"),
                ("compute", "ref"), ("update_and_compute", "actor"), *AROUND_THE_PUSH]
    for events, _ in on["steps"]:
        assert compact(events) == expected
    without = [("generate",), ("compute", "actor"), ("compute", "ref"), ("update", "actor"), ("push", "actor")]
    for events, _ in off["steps"]:
        assert events == without


def test_every_server_resume_finds_the_cache_emptied_and_the_ledger_at_the_estimates_phase(runs):
    """The logical GPU's ledger of training states, from the bytes each offload reported (the
    totals counted on the engines' own tensors): at the weights' resume only the actor's
    parameters are left (the push phase's training part), at the KV cache's nothing (the rollout
    phase's, everything planned being offloaded); and no resume comes before the caches of both
    training processes were emptied after the last offload."""
    on, _ = runs
    total = {"actor": {k: sum(c[k] for c in on["actor_bytes"]) for k in ("params", "grads", "optimizer")},
             "ref": {"params": sum(c["params"] for c in on["ref_bytes"]), "grads": 0, "optimizer": 0}}
    for events, _ in on["steps"]:
        resident = {role: dict(parts) for role, parts in total.items()}
        emptied = set()
        for event in events:
            if event[0] == "onload":
                resident[event[1]] = dict(total[event[1]])
            elif event[0] == "offload":
                for part, freed in event[3].items():
                    resident[event[1]][part] -= freed
                emptied = set()
            elif event[0] == "empty_cache":
                emptied.add(event[1])
            elif event[0] == "resume":
                assert emptied == {"actor", "ref"}, event
                held = {role: {p: b for p, b in parts.items() if b} for role, parts in resident.items()}
                if event[1] == {0: ("weights",)}:
                    assert held == {"actor": {"params": total["actor"]["params"]}, "ref": {}}, held
                else:
                    assert held == {"actor": {}, "ref": {}}, held
        assert [e[1] for e in events if e[0] == "resume"] == [{0: ("weights",)}, {0: ("kv_cache", "cuda_graph")}]


def test_a_checkpoint_onloads_the_roles_and_gives_the_servers_their_weights_back(runs):
    on, off = runs
    events, written, versions = on["save"]
    assert compact(events) == [("release", {0: ALL_TAGS}), ("onload", "actor"), ("onload", "ref"), *AROUND_THE_PUSH]
    assert written and versions == [str(STEPS)] * SERVERS  # pushed again at the same version
    events, written, versions = off["save"]
    assert events == [] and written and versions == [str(STEPS)] * SERVERS


def test_offload_on_is_bit_identical_to_offload_off_with_a_separate_old_log_prob_pass(runs):
    on, off = runs
    for (_, m_on), (_, m_off) in zip(on["steps"], off["steps"]):
        compared = {k: v for k, v in m_off.items() if not k.startswith(TIMED)}
        assert {k: m_on[k] for k in compared} == compared
        assert {"actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy_before_update", "reward/mean",
                "rollout/response_tokens"} <= compared.keys()
    for rank_on, rank_off in zip(on["weights"], off["weights"]):
        assert len(rank_on) == len(rank_off) > 0
        assert all(a.equal(b) for a, b in zip(rank_on, rank_off))
    for _, metrics in off["steps"]:
        assert metrics["perf/offload_bytes"] == metrics["perf/offload_freed_bytes"] == 0


def test_reported_bytes_are_the_storages_each_key_names(runs):
    on, _ = runs
    actor, ref = on["actor_bytes"], on["ref_bytes"]
    for counts in actor + ref:
        assert counts["params"] >= counts["numel_bytes"] > 0  # DDP's buffer may pad
    assert all(c["grads"] > 0 and c["optimizer"] > 0 for c in actor)
    copied = sum(c["params"] + c["optimizer"] for c in actor) + sum(c["params"] for c in ref)
    dropped = sum(c["grads"] for c in actor)
    for _, metrics in on["steps"]:  # every step after the first update holds the same states
        assert metrics["perf/offload_bytes"] == copied
        assert metrics["perf/offload_freed_bytes"] == copied + dropped
        assert metrics["perf/offload_s"] > 0 and metrics["perf/onload_s"] > 0


def test_the_memory_estimate_offloads_what_the_trainer_offloads(runs):
    offloaded = {}
    for name, run in zip(("on", "off"), runs):
        model = run["config"].actor_rollout_ref.model.path
        est = estimate(run["plan"], run["config"], arch_from_hf_config(load_hf_config(model), f"{model}/config.json"))
        offloaded[name] = {e[1] for events, _ in run["steps"] for e in events if e[0] == "offload"}
        assert {r.role for r in est.roles if r.offloadable > 0} == offloaded[name]
    assert offloaded == {"on": {"actor", "ref"}, "off": set()}


def test_a_restarted_server_holds_its_memory_and_is_resumed_only_once_released(runs):
    """Issue 40, finding 1: after a restart the push resumed `weights` on a server that had released
    nothing, which ends a SGLang 0.5.23 server (KeyError; the CPU server ends the same way). Issue 49,
    finding 4: the push then onloaded the actor beside the server's KV cache. Killed between steps
    at TP1, the server is restarted holding all its memory; the push at the current version that
    brings it up to date has it release everything before the actor comes back, and resumes only
    what it released; the step then runs in the usual order."""
    on, _ = runs
    events, metrics = on["restart_step"]
    assert metrics["faults/rollout_server_restarts"] == 1 and metrics["rollout/samples"] > 0
    first_push = compact(events).index(("push", "actor"))
    # the generation (`Cluster.generate`, before the fleet generates) found it dead: restarted (in the
    # rollout phase: nothing left to offload), then the push at the current version, with the push's
    # moves as always
    assert compact(events)[:first_push + 1] == [
        ("release", {0: ALL_TAGS}), ("onload", "actor"), ("offload", "actor", ("grads", "optimizer")),
        ("empty_cache", "actor"), ("empty_cache", "ref"), ("resume", {0: ("weights",)}), ("push", "actor")]
    # after the restart's push, its KV cache back, the fleet generates, then the step as always
    rest = compact(events)[first_push + 1:]
    assert rest[rest.index(("resume", {0: ("kv_cache", "cuda_graph")})) + 1] == ("generate",)
    assert [e for e in rest if e[0] in ("release", "resume")] == [
        ("resume", {0: ("kv_cache", "cuda_graph")}), ("release", {0: ALL_TAGS}), ("resume", {0: ("weights",)}),
        ("resume", {0: ("kv_cache", "cuda_graph")})]
