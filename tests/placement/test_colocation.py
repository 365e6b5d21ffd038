"""The offload plan (megarl.placement.colocation) per case, and the memory estimate subtracting
exactly what it names; the config rule that refuses offload keys where nothing is offloaded;
whether the rollout servers release their memory for training."""
import logging

import pytest

from megarl.bridge import arch_from_hf_config
from megarl.config import ConfigError, load_and_validate
from megarl.placement import plan_from_config
from megarl.placement.colocation import OffloadParts, offload_plan, releases_server_memory
from megarl.placement.memory import estimate, stage_params

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"]
ACTOR, REF, CRITIC = "actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron"
ARCH = arch_from_hf_config({
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
    "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": False})


def cfg(*overrides):
    return load_and_validate(None, REQUIRED + list(overrides))


def plan_of(config):
    return offload_plan(config, plan_from_config(config).roles)


@pytest.mark.parametrize("keys, expected", [
    ((), {}),
    ((f"{ACTOR}.param_offload=true",), {"actor": OffloadParts(params=True)}),
    ((f"{ACTOR}.grad_offload=true", f"{ACTOR}.optimizer_offload=true"),
     {"actor": OffloadParts(grads=True, optimizer=True)}),
    # the reference model has parameters only: its gradient and optimizer keys name nothing
    (("actor_rollout_ref.actor.use_kl_loss=true", f"{REF}.param_offload=true", f"{REF}.grad_offload=true",
      f"{REF}.optimizer_offload=true"), {"ref": OffloadParts(params=True)}),
    (("actor_rollout_ref.actor.use_kl_loss=true", f"{REF}.grad_offload=true"), {}),
    # keys of a role the algorithm does not build name nothing
    ((f"{REF}.param_offload=true",), {}),
    (("algorithm.adv_estimator=gae", "critic.enable=true", "critic.model.path=/models/m",
      f"{CRITIC}.optimizer_offload=true"), {"critic": OffloadParts(optimizer=True)}),
])
def test_colocated_plan_follows_each_roles_keys(keys, expected):
    assert plan_of(cfg(*keys)) == expected


def test_split_placement_offloads_nothing_and_warns_about_the_keys(caplog):
    """verl's split-placement scripts (fully async, one-step-off) set offload keys: the run goes on,
    as verl's does, with one warning naming them (issue 52: megarl refused the config)."""
    split = ["placement.mode=split", "placement.rollout_gpus=4"]
    assert plan_of(cfg(*split)) == {}
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = cfg(*split, f"{ACTOR}.param_offload=true", f"{ACTOR}.grad_offload=true")
    assert plan_of(config) == {}
    lines = [r.getMessage() for r in caplog.records if "offload happens only" in r.getMessage()]
    assert lines[0] == (f"{ACTOR}.param_offload, {ACTOR}.grad_offload: offload happens only with placement.mode=colocate "
                     "(split pools give the rollout servers their own GPUs, so nothing is offloaded); ignored")


@pytest.mark.parametrize("keys, releases", [
    ((), True),  # colocated (the default) with free_cache_engine (verl's default, true)
    (("actor_rollout_ref.rollout.free_cache_engine=false",), False),
    (("placement.mode=split", "placement.rollout_gpus=4"), False),  # the servers have their own GPUs
    (("placement.mode=split", "placement.rollout_gpus=4", "actor_rollout_ref.rollout.free_cache_engine=true"), False),
])
def test_servers_release_their_memory_only_colocated_with_free_cache_engine(keys, releases):
    assert releases_server_memory(cfg(*keys)) is releases


def test_reward_model_offload_is_refused():
    with pytest.raises(ConfigError) as info:
        cfg("reward_model.enable=true", "reward_model.model.path=/models/rm", "reward_model.megatron.param_offload=true")
    assert "reward_model.megatron.param_offload: the reward model scores while the rollout servers" in str(info.value)


def test_estimate_subtracts_exactly_the_planned_parts():
    base = ["actor_rollout_ref.actor.use_kl_loss=true", "placement.gpu_memory_gib=80",
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false"]
    off = cfg(*base)
    on = cfg(*base, f"{ACTOR}.param_offload=true", f"{ACTOR}.optimizer_offload=true", f"{REF}.param_offload=true",
             f"{REF}.grad_offload=true")
    est_off, est_on = (estimate(plan_from_config(c), c, ARCH) for c in (off, on))
    params = stage_params(ARCH, 1)  # TP 1, bf16 weights, fp32 master copy + Adam moments
    actor, ref = est_on.roles
    assert actor.offloadable == params * 2 + params * 12
    assert ref.offloadable == params * 2  # its grad key names nothing
    assert [r.offloadable for r in est_off.roles] == [0, 0]
    # a tiny model under a 40 GiB rollout pool: the rollout phase is the peak, lowered by what is offloaded
    assert est_off.peak - est_on.peak == actor.offloadable + ref.offloadable
