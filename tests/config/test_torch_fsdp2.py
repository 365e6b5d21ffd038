"""`<role>.megatron.use_torch_fsdp2` (megarl.config.rules.fsdp2): verl's Megatron Lite `impl_cfg.optimizer=fsdp2`
maps to it, and a trained role refuses what phase 1 does not build, each message naming its key."""
import logging

import pytest

from megarl.config import ConfigError, load_and_validate, load_config

BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
ACTOR = "actor_rollout_ref.actor.megatron"
ON = [f"{ACTOR}.use_torch_fsdp2=true", f"{ACTOR}.use_distributed_optimizer=false"]
MLITE = ["hydra.searchpath=[pkg://verl_mlite.config]", "actor@actor_rollout_ref.actor=mlite_actor"]
NOT_BUILT = "not built yet with megatron.use_torch_fsdp2"


def test_off_by_default_and_valid_when_on():
    assert load_config(None, BASE).actor_rollout_ref.actor.megatron.use_torch_fsdp2 is False
    config = load_and_validate(None, [*BASE, *ON, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                      "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.optim.weight_decay=0.1"])
    assert config.actor_rollout_ref.actor.megatron.use_torch_fsdp2


def test_expert_parallelism_is_built():
    """Phase 2: EP > 1 trains with FSDP2 (the experts sharded over megatron's expert-DP group,
    tests/engines/test_fsdp2.py), on the actor and on the critic."""
    config = load_and_validate(None, [*BASE, *ON, f"{ACTOR}.expert_model_parallel_size=2"])
    assert config.actor_rollout_ref.actor.megatron.expert_model_parallel_size == 2
    load_and_validate(None, [*BASE, "critic.enable=true", "critic.megatron.use_torch_fsdp2=true",
                             "critic.megatron.use_distributed_optimizer=false",
                             "critic.megatron.expert_model_parallel_size=2"])


@pytest.mark.parametrize("overrides", [
    [*MLITE, "+actor_rollout_ref.actor.engine.impl_cfg.optimizer=fsdp2"],
    # verl's SFT trainer: Megatron Lite's engine is the actor's
    ["hydra.searchpath=[pkg://verl_mlite.config]", "engine=mlite", "+engine.impl_cfg.optimizer=fsdp2"],
])
def test_megatron_lites_fsdp2_optimizer_is_use_torch_fsdp2(overrides):
    """Megatron Lite's fsdp2 (primitive/optimizers/fsdp2: torch fully_shard + AdamW on the shards) is not
    megatron-core's distributed optimizer (its dist_opt)."""
    sft = "engine=mlite" in overrides
    config = load_config(None, [*(["model.path=/m"] if sft else BASE), *overrides], verl_sft=sft)
    megatron = config.actor_rollout_ref.actor.megatron
    assert megatron.use_torch_fsdp2 is True and megatron.use_distributed_optimizer is False


def test_megatron_lites_dist_opt_is_not_fsdp2():
    megatron = load_config(None, [*BASE, *MLITE, "+actor_rollout_ref.actor.engine.impl_cfg.optimizer=dist_opt"]
                           ).actor_rollout_ref.actor.megatron
    assert megatron.use_torch_fsdp2 is False and megatron.use_distributed_optimizer is True


@pytest.mark.parametrize("extra, key", [
    ([f"{ACTOR}.use_distributed_optimizer=true"],
     f"{ACTOR}.use_distributed_optimizer=true with {ACTOR}.use_torch_fsdp2"),
    ([f"{ACTOR}.pipeline_model_parallel_size=2"], f"{ACTOR}.pipeline_model_parallel_size=2"),
    ([f"{ACTOR}.tensor_model_parallel_size=2", f"{ACTOR}.sequence_parallel=true"], f"{ACTOR}.sequence_parallel=true"),
    ([f"{ACTOR}.param_offload=true"], f"{ACTOR}.param_offload=true"),
    ([f"{ACTOR}.grad_offload=true"], f"{ACTOR}.grad_offload=true"),
    ([f"{ACTOR}.optimizer_offload=true"], f"{ACTOR}.optimizer_offload=true"),
    ([f"{ACTOR}.qat.enable=true"], f"{ACTOR}.qat.enable=true"),
    (["actor_rollout_ref.actor.optim.optimizer=sgd"], "actor_rollout_ref.actor.optim.optimizer=sgd"),
    (["+actor_rollout_ref.actor.optim.override_optimizer_config.decoupled_lr=0.1"],
     "actor_rollout_ref.actor.optim.override_optimizer_config (sets ['decoupled_lr'])"),
    (["actor_rollout_ref.model.lora.rank=8"], "actor_rollout_ref.model.lora.rank=8"),
    (["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true"],
     "actor_rollout_ref.model.mtp.enable_train=true"),
    (["actor_rollout_ref.model.dtype=float16"], "actor_rollout_ref.model.dtype=float16"),
    (["actor_rollout_ref.actor.checkpoint.async_save=true"], "actor_rollout_ref.actor.checkpoint.async_save=true"),
])
def test_what_phase_one_does_not_build_is_refused_naming_the_key(extra, key):
    load_and_validate(None, [*BASE, *extra])  # valid without use_torch_fsdp2
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, [*BASE, *ON, *extra])
    lines = [line for line in str(info.value).splitlines() if "use_torch_fsdp2" in line]
    assert len(lines) == 1 and lines[0].strip().removeprefix("- ").startswith(key), str(info.value)
    assert NOT_BUILT in lines[0] or "FSDP2 shards the optimizer state itself" in lines[0]


def test_checkpoints_are_saved_and_resumed_but_not_in_the_background():
    """Saving (trainer.save_freq) and resuming from a path are built (engines.megatron.fsdp2_checkpoint);
    a background write is not, refused naming the role's key."""
    load_and_validate(None, [*BASE, *ON, "trainer.save_freq=5", "trainer.resume_mode=resume_path",
                             "trainer.resume_from_path=/ckpt/global_step_5"])
    critic = ["critic.enable=true", "critic.megatron.use_torch_fsdp2=true",
              "critic.megatron.use_distributed_optimizer=false"]
    load_and_validate(None, [*BASE, *critic])
    with pytest.raises(ConfigError,
                       match="critic.checkpoint.async_save=true with critic.megatron.use_torch_fsdp2=true"):
        load_and_validate(None, [*BASE, *critic, "critic.checkpoint.async_save=true"])


def test_the_critic_is_checked_where_it_runs_and_a_forward_only_role_ignores_the_key(caplog):
    critic = ["critic.megatron.use_torch_fsdp2=true", "critic.megatron.pipeline_model_parallel_size=2"]
    load_and_validate(None, [*BASE, *critic, "algorithm.adv_estimator=grpo"])  # the critic does not run
    with pytest.raises(ConfigError, match=f"critic.megatron.pipeline_model_parallel_size=2 with "
                                          f"critic.megatron.use_torch_fsdp2=true: {NOT_BUILT}"):
        load_and_validate(None, [*BASE, *critic, "critic.enable=true",
                                 "critic.megatron.use_distributed_optimizer=false"])
    load_and_validate(None, [*BASE, "actor_rollout_ref.ref.megatron.use_torch_fsdp2=true",
                             "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2"])


def test_each_key_is_refused_once_with_every_problem_listed(caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as info:
        load_and_validate(None, [*BASE, *ON, f"{ACTOR}.param_offload=true", f"{ACTOR}.qat.enable=true"])
    lines = [line for line in str(info.value).splitlines() if NOT_BUILT in line]
    assert [line.strip()[2:].split(" ")[0] for line in lines] == [f"{ACTOR}.param_offload=true",
                                                                   f"{ACTOR}.qat.enable=true"]
