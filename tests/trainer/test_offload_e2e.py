"""Colocated offload end to end on CPU: configs/tiny/grpo.yaml on one logical GPU (TP=1 actor, a
reference model for the KL loss, one colocated CPU-engine server; offloading is per rank, so more
ranks add nothing here but CI time) for 2 steps with the actor's parameters, gradients
and optimizer state and the reference model's parameters offloaded while generating, against the
same run with offload off, the servers keeping their memory (`rollout.free_cache_engine=false`,
as the CPU quickstart runs) and the old log-probs made by a separate pass before the update
(`actor.old_log_probs_in_update=false`; the offload run's update makes them itself).

Checked: the servers start and release their memory before any engine initialises; every step
calls generate, release, onload, compute, update, push, offload, resume in that order (and a
checkpoint release, onload, save, push, offload, resume); the run is
bit-identical to the other (metrics and weights; one mini-batch per step, whose log-probs the
update takes from its own forward); the bytes a step reports equal the
sizes of the storages each key names, counted on the engines' own tensors; `megarl plan`'s
estimate offloads exactly the roles the trainer offloads. Without `free_cache_engine` no server
releases or resumes anything, at start or in a step, and the run is still the same.
"""
import pytest
import ray
import torch

from megarl.bridge import arch_from_hf_config, load_hf_config
from megarl.placement.memory import estimate
from megarl.rollout.control import ServerControl
from megarl.trainer import cluster as cluster_module
from megarl.trainer.engine_group import EngineGroup
from megarl.trainer.rollout_fleet import RolloutFleet

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
        return [ServerControl(url).server_info()["internal_states"][0]["released_memory"]
                for fleet in cls.fleets for url in fleet.urls]


class RecordingEngineGroup(EngineGroup):
    def __init__(self, role, pools, config, *args, **kwargs):
        Recorder.events.append(("init", role.name, Recorder.server_memory()))
        super().__init__(role, pools, config, *args, **kwargs)
        call = self.workers.call

        def recording(method, *args, **kw):
            if method == "push_weights":
                Recorder.events.append(("push", self.name))
            return call(method, *args, **kw)

        self.workers.call = recording

    def call(self, method, *args, **kwargs):
        if method in ("offload", "onload"):
            Recorder.events.append((method, self.name))
        return super().call(method, *args, **kwargs)

    def compute(self, method, batch, *args):
        Recorder.events.append(("compute", self.name))
        return super().compute(method, batch, *args)

    def update(self, method, batch):
        Recorder.events.append(("update", self.name))
        return super().update(method, batch)

    def update_and_compute(self, method, batch):
        Recorder.events.append(("update_and_compute", self.name))
        return super().update_and_compute(method, batch)


class RecordingFleet(RolloutFleet):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Recorder.fleets.append(self)
        Recorder.events.append(("servers_started",))

    def generate(self, *args, **kwargs):
        Recorder.events.append(("generate",))
        return super().generate(*args, **kwargs)

    def release_memory(self):
        Recorder.events.append(("release",))
        super().release_memory()

    def resume_kv_cache(self):
        Recorder.events.append(("resume_kv",))
        super().resume_kv_cache()


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


def _run(tiny_assets, out_dir, tiny_grpo_cluster, monkeypatch, *overrides) -> dict:
    monkeypatch.setattr(cluster_module, "EngineGroup", RecordingEngineGroup)
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
                          [ServerControl(url).weight_version() for url in cluster.rollout.urls])
        cluster.before_training()  # the engines back on their devices, to be read
        result["actor_bytes"] = ray.get([a.__ray_call__.remote(_state_bytes) for a in cluster.actor.workers.actors])
        result["ref_bytes"] = ray.get([a.__ray_call__.remote(_state_bytes) for a in cluster.ref.workers.actors])
        result["weights"] = ray.get([a.__ray_call__.remote(_weights) for a in cluster.actor.workers.actors])
        result["config"], result["plan"] = cluster.config, cluster.plan
    return result


@pytest.fixture(scope="module")
def runs(tiny_assets, tmp_path_factory, tiny_grpo_cluster, ray_two_gpus):
    with pytest.MonkeyPatch.context() as monkeypatch:
        on = _run(tiny_assets, tmp_path_factory.mktemp("on"), tiny_grpo_cluster, monkeypatch, *OFFLOAD)
        off = _run(tiny_assets, tmp_path_factory.mktemp("off"), tiny_grpo_cluster, monkeypatch, KEEP_MEMORY,
                   SEPARATE_OLD_LOG_PROBS)
    return on, off


def test_servers_release_their_memory_before_the_engines_initialise(runs):
    on, _ = runs
    start = on["start"]
    assert start[0] == ("servers_started",) and start[1] == ("release",)
    inits = [e for e in start if e[0] == "init"]
    assert [e[1] for e in inits] == ["actor", "ref"]
    for _, role, memory in inits:
        assert memory == [["cuda_graph", "kv_cache", "weights"]] * SERVERS, (role, memory)
    # then the first push (the servers' weights back), the planned offload, the KV cache back
    assert start[len(start) - 4:] == [("push", "actor"), ("offload", "actor"), ("offload", "ref"), ("resume_kv",)]


def test_servers_that_keep_their_memory_are_never_released(runs):
    _, off = runs
    start = off["start"]
    assert start[0] == ("servers_started",) and ("release",) not in start and ("resume_kv",) not in start
    inits = [e for e in start if e[0] == "init"]
    assert [e[1] for e in inits] == ["actor", "ref"]
    for _, role, memory in inits:
        assert memory == [[]] * SERVERS, (role, memory)
    assert start[-1] == ("push", "actor")


def test_every_step_offloads_around_generation_in_order(runs):
    on, off = runs
    expected = [("generate",), ("release",), ("onload", "actor"), ("onload", "ref"), ("compute", "ref"),
                ("update_and_compute", "actor"), ("push", "actor"), ("offload", "actor"), ("offload", "ref"),
                ("resume_kv",)]
    for events, _ in on["steps"]:
        assert events == expected
    without = [("generate",), ("compute", "actor"), ("compute", "ref"), ("update", "actor"), ("push", "actor")]
    for events, _ in off["steps"]:
        assert events == without


def test_a_checkpoint_onloads_the_roles_and_gives_the_servers_their_weights_back(runs):
    on, off = runs
    events, written, versions = on["save"]
    assert events == [("release",), ("onload", "actor"), ("onload", "ref"), ("push", "actor"), ("offload", "actor"),
                      ("offload", "ref"), ("resume_kv",)]
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
