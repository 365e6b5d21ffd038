"""`<role>.megatron.use_torch_fsdp2` (megarl.config.rules.fsdp2): verl's Megatron Lite `impl_cfg.optimizer=fsdp2`
maps to it, a trained role refuses what is not built, each message naming its key, and takes pipeline parallelism,
the offload keys and the `optim.override_optimizer_config` fields whose meaning FSDP2 runs (`fsdp2_optimizer_overrides`)."""
import logging

import pytest

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.rules.fsdp2 import PRECISION_DTYPE_FIELDS, fsdp2_optimizer_overrides

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
    ([f"{ACTOR}.tensor_model_parallel_size=2", f"{ACTOR}.sequence_parallel=true"], f"{ACTOR}.sequence_parallel=true"),
    ([f"{ACTOR}.qat.enable=true"], f"{ACTOR}.qat.enable=true"),
    (["actor_rollout_ref.actor.optim.optimizer=sgd"], "actor_rollout_ref.actor.optim.optimizer=sgd"),
    (["+actor_rollout_ref.actor.optim.override_optimizer_config.decoupled_lr=0.1"],
     "actor_rollout_ref.actor.optim.override_optimizer_config.decoupled_lr=0.1"),
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
    critic = ["critic.megatron.use_torch_fsdp2=true", "critic.optim.optimizer=sgd"]
    load_and_validate(None, [*BASE, *critic, "algorithm.adv_estimator=grpo"])  # the critic does not run
    with pytest.raises(ConfigError, match=f"critic.optim.optimizer=sgd with "
                                          f"critic.megatron.use_torch_fsdp2=true: {NOT_BUILT}"):
        load_and_validate(None, [*BASE, *critic, "critic.enable=true",
                                 "critic.megatron.use_distributed_optimizer=false"])
    load_and_validate(None, [*BASE, "actor_rollout_ref.ref.megatron.use_torch_fsdp2=true",
                             "actor_rollout_ref.ref.megatron.use_distributed_optimizer=true"])


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
@pytest.mark.parametrize("layout", [["pipeline_model_parallel_size=2"],
                                    ["pipeline_model_parallel_size=2", "virtual_pipeline_model_parallel_size=2"]])
def test_pipeline_parallelism_is_built(role, layout):
    """PP (1F1B) and VPP (interleaved) with FSDP2 on a trained role (engines.megatron.fsdp2; checked against
    megatron's DDP in tests/engines/test_fsdp2.py)."""
    keys = [f"{role}.megatron.{k}" for k in ("use_torch_fsdp2=true", "use_distributed_optimizer=false", *layout)]
    config = load_and_validate(None, [*BASE, "trainer.n_gpus_per_node=4", "critic.enable=true", *keys])
    megatron = config.critic.megatron if role == "critic" else config.actor_rollout_ref.actor.megatron
    assert megatron.use_torch_fsdp2 and megatron.pipeline_model_parallel_size == 2


def test_each_key_is_refused_once_with_every_problem_listed(caplog):
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as info:
        load_and_validate(None, [*BASE, *ON, f"{ACTOR}.qat.enable=true", "actor_rollout_ref.actor.optim.optimizer=sgd"])
    lines = [line for line in str(info.value).splitlines() if NOT_BUILT in line]
    assert [line.strip()[2:].split(" ")[0] for line in lines] == [f"{ACTOR}.qat.enable=true",
                                                                   "actor_rollout_ref.actor.optim.optimizer=sgd"]


OPTIM = "actor_rollout_ref.actor.optim.override_optimizer_config"


def _decide(optimizer_offload: bool = True, **overrides) -> tuple[list[str], list[str]]:
    return fsdp2_optimizer_overrides(overrides, optimizer_offload, "actor_rollout_ref.actor", "use_torch_fsdp2")


def test_the_offload_keys_are_valid_with_fsdp2():
    """Parameters, gradients and AdamW state move between phases (engines.megatron.offload, on the shards)."""
    config = load_and_validate(None, [*BASE, *ON, f"{ACTOR}.param_offload=true", f"{ACTOR}.grad_offload=true",
                                      f"{ACTOR}.optimizer_offload=true"])
    megatron = config.actor_rollout_ref.actor.megatron
    assert megatron.use_torch_fsdp2 and megatron.param_offload and megatron.grad_offload and megatron.optimizer_offload


def test_megatron_cores_defaults_are_what_the_rule_assumes():
    """The oracle of the rule's premises: megatron-core's OptimizerConfig keeps every precision-aware dtype at
    float32 and decoupled weight decay (AdamW) by default, and offloads no fraction of the state."""
    import dataclasses

    import torch
    from megatron.core.optimizer import OptimizerConfig

    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    assert all(defaults[name] == torch.float32 for name in PRECISION_DTYPE_FIELDS)
    assert defaults["decoupled_weight_decay"] is True and defaults["use_precision_aware_optimizer"] is False
    assert defaults["optimizer_cpu_offload"] is False and defaults["optimizer_offload_fraction"] == 0.0


def test_decoupled_weight_decay_true_is_fsdp2s_adamw_and_false_is_refused():
    # megatron-core: "If true, decouples weight decay from the gradient update, equivalent to AdamW. If false,
    # original Adam update rule will be used."
    assert _decide(decoupled_weight_decay=True) == ([], [])
    _, refused = _decide(decoupled_weight_decay=False)
    assert len(refused) == 1 and refused[0].startswith(f"{OPTIM}.decoupled_weight_decay=False with ")
    assert "AdamW" in refused[0]


def test_the_whole_optimizer_offloaded_is_accepted_with_a_warning_where_the_state_leaves_between_phases():
    # megatron-core: optimizer_cpu_offload "offload optimizer states tensor and compute to CPU";
    # optimizer_offload_fraction "the fraction of optimizer states to offload from GPU memory to CPU" (1.0: all);
    # what verl's Megatron Lite offload_fraction=1.0 sets (megarl.config.verl_groups)
    warned, refused = _decide(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                              overlap_cpu_optimizer_d2h_h2d=True)
    assert refused == []
    assert len(warned) == 2 and warned[0].startswith(f"{OPTIM}.optimizer_offload_fraction=1.0 with ")
    assert "actor_rollout_ref.actor.megatron.optimizer_offload=true" in warned[0] and "in the update" in warned[0]
    assert warned[1].startswith(f"{OPTIM}.overlap_cpu_optimizer_d2h_h2d=True has no effect")
    # without megatron.optimizer_offload the state would never leave the device: refused, naming that key
    warned, refused = _decide(False, optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    assert warned == [] and len(refused) == 1
    assert refused[0].startswith(f"{OPTIM}.optimizer_offload_fraction=1.0 with ")
    assert "set actor_rollout_ref.actor.megatron.optimizer_offload=true" in refused[0]


@pytest.mark.parametrize("fraction", [0.5, 1.5, -0.1, "all", True])
def test_a_partial_or_invalid_fraction_is_refused_naming_the_key(fraction):
    warned, refused = _decide(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)
    assert warned == [] and len(refused) == 1
    assert refused[0].startswith(f"{OPTIM}.optimizer_offload_fraction={fraction}")


@pytest.mark.parametrize("overrides, key", [
    # megatron-core's HybridDeviceOptimizer moves parameters to the host while their count is under the
    # fraction of the total (cpu_offloading/hybrid_optimizer.py): 0.0 moves none
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.0}, "optimizer_offload_fraction=0.0"),
    ({"optimizer_offload_fraction": 1.0}, "optimizer_offload_fraction=1.0"),  # read only with optimizer_cpu_offload
    ({"optimizer_cpu_offload": True}, "optimizer_cpu_offload=True"),  # the fraction's default: 0.0
])
def test_an_offload_that_megatron_core_would_not_do_has_no_effect_and_warns(overrides, key):
    warned, refused = _decide(False, **overrides)
    assert refused == [] and len(warned) == 1 and "has no effect" in warned[0]
    assert warned[0].startswith(f"{OPTIM}.{key} has no effect")


def test_the_precision_aware_optimizer_at_float32_is_accepted_and_a_lower_dtype_refused():
    # megatron-core: use_precision_aware_optimizer "allows optimizer-related tensors (master_param, gradients and
    # optimizer states) to be set to lower precision", by main_grads_dtype, main_params_dtype, exp_avg_dtype,
    # exp_avg_sq_dtype (each "dtype of ... when enabling precision-aware-optimizer", float32 by default)
    warned, refused = _decide(use_precision_aware_optimizer=True)
    assert refused == [] and len(warned) == 1 and warned[0].startswith(f"{OPTIM}.use_precision_aware_optimizer=True")
    assert "float32" in warned[0]
    assert _decide(use_precision_aware_optimizer=True, main_params_dtype="torch.float32")[1] == []
    assert _decide(use_precision_aware_optimizer=False) == ([], [])
    warned, refused = _decide(use_precision_aware_optimizer=True, exp_avg_dtype="bfloat16")
    assert warned == [] and len(refused) == 1 and refused[0].startswith(f"{OPTIM}.exp_avg_dtype=bfloat16 with ")


def test_another_optimizer_config_field_is_refused_naming_it():
    warned, refused = _decide(decoupled_lr=0.1, adam_eps=1e-6)
    assert warned == [] and [r.split(" ")[0] for r in refused] == [f"{OPTIM}.decoupled_lr=0.1", f"{OPTIM}.adam_eps=1e-06"]


def test_megatron_lites_offloading_fsdp2_sft_validates_with_warnings(caplog):
    """verl's SFT script for Megatron Lite (examples/sft/gsm8k/run_deepseek_v4_megatron_lite.sh, its layout left
    out): every offload, the whole optimizer offloaded, the precision-aware optimizer and AdamW."""
    overrides = ["model.path=/m", "hydra.searchpath=[pkg://verl_mlite.config]", "engine=mlite",
                 "+engine.impl_cfg.optimizer=fsdp2", "engine.param_offload=True", "engine.optimizer_offload=True",
                 "engine.grad_offload=True", "+optim.override_optimizer_config.offload_fraction=1.0",
                 "+optim.override_optimizer_config.use_precision_aware_optimizer=True",
                 "+optim.override_optimizer_config.decoupled_weight_decay=True", "data.train_files=/d.parquet",
                 "trainer.n_gpus_per_node=2"]
    with caplog.at_level(logging.WARNING):
        config = load_and_validate(None, overrides, verl_sft=True)
    actor = config.actor_rollout_ref.actor
    assert actor.megatron.use_torch_fsdp2 and actor.megatron.optimizer_offload and actor.megatron.param_offload
    assert actor.optim.override_optimizer_config["optimizer_offload_fraction"] == 1.0
    for field in ("optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer"):
        assert f"{OPTIM}.{field}=" in caplog.text, field


def test_on_a_cpu_the_megatron_core_only_optimizer_fields_are_refused_for_ddp_only():
    """megatron-core's host optimizer and precision-aware optimizer need CUDA (megarl.config.devices
    CUDA_ONLY_OPTIMIZER_FIELDS); FSDP2 builds neither, and takes the fields as `fsdp2_optimizer_overrides` says."""
    fields = ["trainer.device=cpu", f"+{OPTIM}.optimizer_cpu_offload=true",
              f"+{OPTIM}.optimizer_offload_fraction=1.0", f"+{OPTIM}.use_precision_aware_optimizer=true",
              f"{ACTOR}.optimizer_offload=true"]
    with pytest.raises(ConfigError, match=f"{OPTIM}.optimizer_cpu_offload=True with trainer.device=cpu"):
        load_and_validate(None, [*BASE, *fields])
    assert load_and_validate(None, [*BASE, *ON, *fields]).trainer.device == "cpu"
