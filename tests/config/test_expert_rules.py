"""The expert-parallel sizes of each training role are checked at load time, naming the keys."""
import pytest

from megarl.config import ConfigError, load_and_validate

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m",
            "trainer.nnodes=1", "trainer.n_gpus_per_node=8"]
ACTOR = "actor_rollout_ref.actor.megatron"


def errors(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, [*REQUIRED, *overrides])
    return str(info.value)


def test_expert_layouts_that_fit_load():
    config = load_and_validate(None, [*REQUIRED, f"{ACTOR}.expert_model_parallel_size=8",
                                      f"{ACTOR}.tensor_model_parallel_size=2", f"{ACTOR}.expert_tensor_parallel_size=1"])
    assert config.actor_rollout_ref.actor.megatron.expert_model_parallel_size == 8
    load_and_validate(None, [*REQUIRED, f"{ACTOR}.expert_model_parallel_size=4", f"{ACTOR}.tensor_model_parallel_size=2"])


@pytest.mark.parametrize("overrides, message", [
    ([f"{ACTOR}.expert_model_parallel_size=3"], f"{ACTOR}: ETP x EP x PP = 1 x 3 x 1 does not divide the 8 training GPUs"),
    ([f"{ACTOR}.tensor_model_parallel_size=2", f"{ACTOR}.expert_tensor_parallel_size=1"],
     f"{ACTOR}.expert_tensor_parallel_size=1 differs from {ACTOR}.tensor_model_parallel_size=2 with "
     f"{ACTOR}.expert_model_parallel_size=1"),
    ([f"{ACTOR}.tensor_model_parallel_size=4", f"{ACTOR}.expert_tensor_parallel_size=2"],
     f"{ACTOR}.expert_tensor_parallel_size=2: must be 1 or {ACTOR}.tensor_model_parallel_size=4"),
    (["actor_rollout_ref.ref.megatron.expert_model_parallel_size=0"],
     "actor_rollout_ref.ref.megatron.expert_model_parallel_size=0: must be a positive integer"),
])
def test_expert_layouts_megatron_cannot_run_are_rejected(overrides, message):
    assert message in errors(*overrides)
