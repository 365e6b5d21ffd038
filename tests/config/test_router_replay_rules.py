"""Routing replay and the MoE router losses are checked at load time, naming the keys."""
import pytest

from megarl.config import ConfigError, load_and_validate
from megarl.rollout.launch import ROUTED_EXPERTS_FLAG, cpu_server_command

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m",
            "trainer.nnodes=1", "trainer.n_gpus_per_node=8"]
MODE = "actor_rollout_ref.actor.router_replay.mode"
RECOMPUTE = "actor_rollout_ref.actor.megatron.override_transformer_config"


def test_replay_is_off_by_default_and_loads_with_verls_key():
    assert load_and_validate(None, REQUIRED).actor_rollout_ref.actor.router_replay.mode == "disabled"
    config = load_and_validate(None, [*REQUIRED, f"{MODE}=R3", "actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=0.01",
                                      "actor_rollout_ref.actor.megatron.moe_z_loss_coeff=0.001"])
    assert config.actor_rollout_ref.actor.megatron.moe_z_loss_coeff == 0.001
    assert ROUTED_EXPERTS_FLAG in cpu_server_command("/m", 1, return_routed_experts=True)
    assert ROUTED_EXPERTS_FLAG not in cpu_server_command("/m", 1)


@pytest.mark.parametrize("overrides, message", [
    ([f"{MODE}=R2"], MODE),  # R2 (replaying the trainer's own routes) is not built
    ([f"{MODE}=R3", "actor_rollout_ref.rollout.agent.path=/a.py"], "agent episodes do not carry routed experts"),
    (["actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=-1"], "moe_aux_loss_coeff=-1.0: must be >= 0"),
])
def test_replay_layouts_that_cannot_work_are_rejected(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, [*REQUIRED, *overrides])
    assert message in str(info.value)


@pytest.mark.parametrize("recompute", [
    ["actor_rollout_ref.model.enable_gradient_checkpointing=true"],
    [f"+{RECOMPUTE}.recompute_granularity=full", f"+{RECOMPUTE}.recompute_method=uniform",
     f"+{RECOMPUTE}.recompute_num_layers=1"],  # verl's examples/router_replay/run_qwen3_30b_a3b_megatron.sh
    [f"+{RECOMPUTE}.recompute_granularity=selective", f"+{RECOMPUTE}.recompute_modules=[moe]"],
    [f"+{RECOMPUTE}.recompute_granularity=selective"],  # core_attn only: the router does not run again
])
def test_replay_takes_any_recompute_with_pipelining(recompute):
    """Each recompute replays its own micro-batch's routes (tests/engines/test_replay_recompute.py)."""
    load_and_validate(None, [*REQUIRED, f"{MODE}=R3", *recompute,
                             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
