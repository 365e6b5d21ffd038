"""`actor_rollout_ref.model.lora` is checked at load time (megarl.config.rules.lora)."""
import pytest

from megarl.config import ConfigError, load_and_validate
from megarl.config.rules.lora import lora_targets

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
KEY = "actor_rollout_ref.model.lora"


def test_lora_is_off_by_default_and_all_linear_names_the_seven_peft_targets():
    config = load_and_validate(None, REQUIRED)
    assert config.actor_rollout_ref.model.lora.rank == 0
    assert lora_targets(["all-linear"]) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert lora_targets(["down_proj", "q_proj"]) == ("q_proj", "down_proj")


@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}.rank=-1"], f"{KEY}.rank=-1: must be >= 0"),
    ([f"{KEY}.rank=8", f"{KEY}.alpha=0"], f"{KEY}.alpha=0.0: must be positive"),
    ([f"{KEY}.rank=8", f"{KEY}.dropout=1.0"], f"{KEY}.dropout=1.0: must be in [0, 1)"),
    ([f"{KEY}.rank=8", f"{KEY}.target_modules=[q_proj,qkv_proj]"], f"{KEY}.target_modules: unknown ['qkv_proj']"),
    ([f"{KEY}.rank=8", f"{KEY}.target_modules=[]"], f"{KEY}.target_modules is empty"),
    ([f"{KEY}.rank=8", f"{KEY}.sync=adapter", "actor_rollout_ref.rollout.check_weight_update=true"],
     f"{KEY}.sync=adapter with actor_rollout_ref.rollout.check_weight_update=true"),
    (["critic.model.lora.rank=8", "critic.model.lora.alpha=0"], "critic.model.lora.alpha=0.0: must be positive"),
    (["critic.model.lora.rank=8", "critic.model.lora.sync=adapter"], "critic.model.lora.sync=adapter: the critic"),
    ([f"{KEY}.rank=8", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.sequence_parallel=true", "trainer.n_gpus_per_node=2"],
     f"{KEY}.rank=8 with actor_rollout_ref.actor.megatron.sequence_parallel=true"),
    (["critic.model.lora.rank=8", "critic.megatron.tensor_model_parallel_size=2", "critic.megatron.sequence_parallel=true",
      "trainer.n_gpus_per_node=2"], "critic.model.lora.rank=8 with critic.megatron.sequence_parallel=true"),
])
def test_bad_lora_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + overrides)
    assert message in str(info.value)


def test_a_valid_lora_config_loads():
    config = load_and_validate(None, REQUIRED + [f"{KEY}.rank=16", f"{KEY}.target_modules=[q_proj,v_proj]"])
    assert config.actor_rollout_ref.model.lora.target_modules == ["q_proj", "v_proj"]
    # sequence_parallel at TP 1 is off (megarl.engines.megatron.parallel.sequence_parallel_on): no conflict
    load_and_validate(None, REQUIRED + [f"{KEY}.rank=16", "actor_rollout_ref.actor.megatron.sequence_parallel=true"])
    adapter = load_and_validate(None, REQUIRED + [f"{KEY}.rank=16", f"{KEY}.sync=adapter"])
    assert adapter.actor_rollout_ref.model.lora.sync == "adapter"


def test_adapter_sync_goes_by_tensors_by_default_and_disk_across_nodes_warns(caplog):
    """sync_via=tensors (the default) needs no shared filesystem; sync_via=disk on more than one
    node warns, naming the keys (a shared trainer.default_local_dir cannot be read from the config)."""
    adapter = [f"{KEY}.rank=8", f"{KEY}.sync=adapter", "actor_rollout_ref.rollout.check_weight_update=false"]
    two_nodes = ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"]
    with caplog.at_level("WARNING", logger="megarl.config"):
        assert load_and_validate(None, REQUIRED + adapter).actor_rollout_ref.model.lora.sync_via == "tensors"
        load_and_validate(None, REQUIRED + adapter + two_nodes)
        load_and_validate(None, REQUIRED + adapter + [f"{KEY}.sync_via=disk"])  # one node: its own disk will do
    assert "sync_via" not in caplog.text
    with caplog.at_level("WARNING", logger="megarl.config"):
        load_and_validate(None, REQUIRED + adapter + two_nodes + [f"{KEY}.sync_via=disk"])
    assert f"{KEY}.sync_via=disk with trainer.nnodes=2" in caplog.text
    assert "trainer.default_local_dir=checkpoints" in caplog.text and "sync_via=tensors" in caplog.text
    with pytest.raises(ConfigError, match="sync_via"):
        load_and_validate(None, REQUIRED + adapter + [f"{KEY}.sync_via=nfs"])
