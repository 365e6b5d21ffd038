"""verl's Megatron-FSDP keys (`*.megatron.use_megatron_fsdp`, SFT's `engine.use_megatron_fsdp`) are megarl
keys: on a trained role they run megarl's PyTorch FSDP2 (the same ZeRO-3 sharding; megarl.config.rules.fsdp2
`fsdp2_switch`) with one warning, and what FSDP2 does not build yet is refused naming the key the user set; on
a forward-only role a warning that nothing changes. The warning's claim that megatron-core's Megatron-FSDP is
CUDA-only is checked against megatron-core's own MegatronFSDP."""
import logging

import pytest
import torch

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.rules.fsdp2 import fsdp2_switch
from megarl.config.schema import MegatronConfig
from megarl.config.verl_compat import SFT_DEFAULTS

ACTOR = "actor_rollout_ref.actor.megatron.use_megatron_fsdp"
BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
RUNS_AS_FSDP2 = ("actor_rollout_ref.actor.megatron.use_megatron_fsdp=true: megarl shards this role with PyTorch "
                 "FSDP2 (actor_rollout_ref.actor.megatron.use_torch_fsdp2:")


@pytest.mark.parametrize("keys, switch", [
    ({}, None),
    ({"use_torch_fsdp2": True}, "use_torch_fsdp2"),
    ({"use_megatron_fsdp": True}, "use_megatron_fsdp"),
    ({"use_megatron_fsdp": True, "use_torch_fsdp2": True}, "use_torch_fsdp2"),
])
def test_the_switch_names_the_key_that_puts_a_role_on_fsdp2(keys, switch):
    assert fsdp2_switch(MegatronConfig(**keys)) == switch


@pytest.mark.parametrize("device", ["cuda", "cpu", "auto"])
def test_verls_actor_key_runs_fsdp2_with_one_warning_on_every_device(device, caplog):
    """verl sets use_distributed_optimizer with it (megatron-core's Megatron-FSDP requires it), megarl's default
    true: not refused, as it is with use_torch_fsdp2."""
    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = load_and_validate(None, [*BASE, f"{ACTOR}=True", f"trainer.device={device}"])
    megatron = config.actor_rollout_ref.actor.megatron
    assert megatron.use_megatron_fsdp and megatron.use_distributed_optimizer and not megatron.use_torch_fsdp2
    assert fsdp2_switch(megatron) == "use_megatron_fsdp"
    assert [r.getMessage()[:len(RUNS_AS_FSDP2)] for r in caplog.records].count(RUNS_AS_FSDP2) == 1


@pytest.mark.parametrize("override, refused", [
    ("actor_rollout_ref.actor.optim.optimizer=sgd",
     "actor_rollout_ref.actor.optim.optimizer=sgd with "
     "actor_rollout_ref.actor.megatron.use_megatron_fsdp=true: not built yet with megatron.use_megatron_fsdp"),
    ("actor_rollout_ref.actor.optim.optimizer=sgd",
     "actor_rollout_ref.actor.optim.optimizer=sgd with actor_rollout_ref.actor.megatron.use_megatron_fsdp=true"),
])
def test_what_fsdp2_does_not_build_is_refused_naming_verls_key(override, refused):
    load_and_validate(None, [*BASE, override, "trainer.n_gpus_per_node=2"])  # valid without the key
    with pytest.raises(ConfigError) as error:
        load_and_validate(None, [*BASE, override, "trainer.n_gpus_per_node=2", f"{ACTOR}=True"])
    assert refused in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the claim checked is the one for a machine without CUDA")
def test_megatron_cores_megatron_fsdp_is_cuda_only_as_the_warning_says():
    # megatron_fsdp.py MegatronFSDP.__init__ reads torch.cuda.current_device() even when given the CPU, before it
    # reads its process groups (dist_index); the message says which failure it is
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MegatronFSDP

    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                        data_parallel_sharding_strategy="optim_grads_params")
    with pytest.raises((AssertionError, RuntimeError), match="Torch not compiled with CUDA enabled|no NVIDIA driver"):
        MegatronFSDP(torch.nn.Linear(2, 2), None, ddp_config=ddp, device=torch.device("cpu"))


def test_verls_reference_key_loads_and_warns_that_it_changes_nothing(caplog):
    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = load_and_validate(None, [*BASE, "actor_rollout_ref.ref.megatron.use_megatron_fsdp=True",
                                          "trainer.device=cuda"])
    assert config.actor_rollout_ref.ref.megatron.use_megatron_fsdp is True
    assert fsdp2_switch(config.actor_rollout_ref.actor.megatron) is None
    assert [r.getMessage() for r in caplog.records].count(
        "actor_rollout_ref.ref.megatron.use_megatron_fsdp=true has no effect: a forward-only role is not wrapped for "
        "data parallelism (verl builds it with wrap_with_ddp=False too), so there is nothing to shard") == 1


def test_verls_sft_key_is_the_actors():
    config = load_config(None, [*SFT_DEFAULTS, "engine.use_megatron_fsdp=True"], verl_sft=True)
    assert fsdp2_switch(config.actor_rollout_ref.actor.megatron) == "use_megatron_fsdp"
    validated = load_and_validate(None, [*SFT_DEFAULTS, "engine.use_megatron_fsdp=True", "trainer.device=cuda",
                                         "model.path=/m", "data.train_files=/d.parquet"],
                                  verl_sft=True, steps_from_data=True)
    assert fsdp2_switch(validated.actor_rollout_ref.actor.megatron) == "use_megatron_fsdp"
