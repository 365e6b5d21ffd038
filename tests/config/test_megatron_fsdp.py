"""verl's Megatron-FSDP keys (`*.megatron.use_megatron_fsdp`, SFT's `engine.use_megatron_fsdp`) are
megarl keys: refused on a trained role with the reason for the device (megarl.config.devices.
megatron_fsdp_problems), a warning on a forward-only one. The CPU rule is checked against megatron-core's
own MegatronFSDP."""
import logging

import pytest
import torch

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.devices import megatron_fsdp_problems
from megarl.config.verl_compat import SFT_DEFAULTS

ACTOR = "actor_rollout_ref.actor.megatron.use_megatron_fsdp"
BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


@pytest.mark.parametrize("device, trained, expected", [
    ("cpu", {"actor_rollout_ref.actor": True}, ["actor_rollout_ref.actor.megatron.use_megatron_fsdp=true with "
                                                "trainer.device=cpu: megatron-core's Megatron-FSDP runs on CUDA only"]),
    ("cuda", {"actor_rollout_ref.actor": True, "critic": True},
     ["actor_rollout_ref.actor.megatron.use_megatron_fsdp=true with trainer.device=cuda: not built yet",
      "critic.megatron.use_megatron_fsdp=true with trainer.device=cuda: not built yet"]),
    ("cuda", {"actor_rollout_ref.actor": False, "critic": False}, []),
    ("cpu", {"actor_rollout_ref.actor": False}, []),
])
def test_megatron_fsdp_problems_per_device(device, trained, expected):
    problems = megatron_fsdp_problems(device, trained)
    assert [p[:len(e)] for p, e in zip(problems, expected)] == expected and len(problems) == len(expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule checked is the one for a machine without CUDA")
def test_megatron_cores_megatron_fsdp_fails_on_cpu_as_the_rule_says():
    # megatron_fsdp.py MegatronFSDP.__init__ reads torch.cuda.current_device() even when given the CPU, before it
    # reads its process groups (dist_index); the message says which failure it is
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MegatronFSDP

    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                        data_parallel_sharding_strategy="optim_grads_params")
    with pytest.raises((AssertionError, RuntimeError), match="Torch not compiled with CUDA enabled|no NVIDIA driver"):
        MegatronFSDP(torch.nn.Linear(2, 2), None, ddp_config=ddp, device=torch.device("cpu"))


@pytest.mark.parametrize("device, reason", [("cuda", "not built yet"), ("cpu", "runs on CUDA only"),
                                            ("auto", "not built yet")])
def test_verls_actor_key_is_known_and_refused_with_the_devices_reason(device, reason):
    load_and_validate(None, [*BASE, f"trainer.device={device}"])  # valid without the key
    config = load_config(None, [*BASE, f"{ACTOR}=True", f"trainer.device={device}"])
    assert config.actor_rollout_ref.actor.megatron.use_megatron_fsdp is True
    with pytest.raises(ConfigError) as error:
        load_and_validate(None, [*BASE, f"{ACTOR}=True", f"trainer.device={device}"])
    (problem,) = str(error.value).splitlines()[1:]
    assert problem.startswith(f"  - {ACTOR}=true with trainer.device=") and reason in problem


def test_verls_reference_key_loads_and_warns_that_it_changes_nothing(caplog):
    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = load_and_validate(None, [*BASE, "actor_rollout_ref.ref.megatron.use_megatron_fsdp=True",
                                          "trainer.device=cuda"])
    assert config.actor_rollout_ref.ref.megatron.use_megatron_fsdp is True
    assert [r.getMessage() for r in caplog.records].count(
        "actor_rollout_ref.ref.megatron.use_megatron_fsdp=true has no effect: a forward-only role is not wrapped for "
        "data parallelism (verl builds it with wrap_with_ddp=False too), so there is nothing to shard") == 1


def test_verls_sft_key_is_the_actors():
    config = load_config(None, [*SFT_DEFAULTS, "engine.use_megatron_fsdp=True"], verl_sft=True)
    assert config.actor_rollout_ref.actor.megatron.use_megatron_fsdp is True
    with pytest.raises(ConfigError, match=f"{ACTOR}=true with trainer.device=cuda: not built yet"):
        load_and_validate(None, [*SFT_DEFAULTS, "engine.use_megatron_fsdp=True", "trainer.device=cuda"],
                          verl_sft=True, steps_from_data=True)
