"""`<role>.megatron.override_transformer_config` (verl's key) at config time, the old-log-prob pass's
verl keys, and `model_engine`: what loads, what is refused naming which keys, and what the reference
inherits. The names themselves are checked against megatron-core's TransformerConfig in
tests/engines/test_transformer_overrides.py."""
import logging

import pytest
import torch

from megarl.config import ConfigError, load_config
from megarl.config.transformer_overrides import Recompute, cp_comm_type_model_problems, recompute_of, role_overrides

from config_cases import REQUIRED, fails, ok

ACTOR = "actor_rollout_ref.actor.megatron.override_transformer_config"
# verl's run_qwen3_30b_a3b_sglang_megatron.sh, as written there
VERL_RECOMPUTE = [f"+{ACTOR}.use_flash_attn=True", f"+{ACTOR}.recompute_method=uniform",
                  f"+{ACTOR}.recompute_granularity=full", f"+{ACTOR}.recompute_num_layers=1"]


def test_verls_recompute_overrides_load_and_use_flash_attn_is_dropped_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = ok(*VERL_RECOMPUTE)
    overrides = config.actor_rollout_ref.actor.megatron.override_transformer_config
    assert overrides == {"recompute_method": "uniform", "recompute_granularity": "full", "recompute_num_layers": 1}
    assert recompute_of(overrides) == Recompute("full", "uniform", 1, ("core_attn",))
    lines = [r.getMessage() for r in caplog.records if "use_flash_attn" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"{ACTOR}.use_flash_attn (verl key") and "ignored" in lines[0]


@pytest.mark.parametrize("role", ["actor_rollout_ref.ref", "critic", "reward_model"])
def test_every_role_takes_overrides(role):
    config = ok(f"+{role}.megatron.override_transformer_config.recompute_granularity=selective",
                f"+{role}.megatron.override_transformer_config.use_flash_attn=true")
    section = {"actor_rollout_ref.ref": config.actor_rollout_ref.ref, "critic": config.critic,
               "reward_model": config.reward_model}[role]
    assert section.megatron.override_transformer_config == {"recompute_granularity": "selective"}


def test_the_reference_inherits_the_actors_overrides_unless_it_has_its_own():
    assert ok(*VERL_RECOMPUTE).actor_rollout_ref.ref.megatron.override_transformer_config["recompute_method"] == "uniform"
    with_layout = ok(*VERL_RECOMPUTE, "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
                     "trainer.n_gpus_per_node=8")
    assert with_layout.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    assert with_layout.actor_rollout_ref.ref.megatron.override_transformer_config["recompute_granularity"] == "full"
    own = ok(*VERL_RECOMPUTE, "+actor_rollout_ref.ref.megatron.override_transformer_config.recompute_granularity=selective")
    assert own.actor_rollout_ref.ref.megatron.override_transformer_config == {"recompute_granularity": "selective"}


def test_gradient_checkpointing_means_full_uniform_one_layer_and_conflicts_are_refused():
    assert recompute_of(role_overrides({}, True)) == Recompute("full", "uniform", 1)
    assert recompute_of(role_overrides({}, False)) == Recompute()
    # the same settings said twice are fine; a different one names both keys
    ok("actor_rollout_ref.model.enable_gradient_checkpointing=true", *VERL_RECOMPUTE)
    msg = fails("actor_rollout_ref.model.enable_gradient_checkpointing=true",
                f"+{ACTOR}.recompute_granularity=selective")
    assert (f"{ACTOR}.recompute_granularity=selective conflicts with "
            "actor_rollout_ref.model.enable_gradient_checkpointing=true, which means recompute_granularity=full") in msg
    # the critic follows the same switch; the reference (forward only) does not
    assert "critic.megatron.override_transformer_config.recompute_method=block conflicts" in fails(
        "actor_rollout_ref.model.enable_gradient_checkpointing=true", "critic.enable=true",
        "+critic.megatron.override_transformer_config.recompute_method=block")
    ok("actor_rollout_ref.model.enable_gradient_checkpointing=true",
       "+actor_rollout_ref.ref.megatron.override_transformer_config.recompute_granularity=selective")


@pytest.mark.parametrize("overrides, expected", [
    ([f"+{ACTOR}.recompute_granularity=full"],
     f"{ACTOR}.recompute_granularity=full needs recompute_method (uniform or block) and recompute_num_layers"),
    ([f"+{ACTOR}.recompute_granularity=selective", f"+{ACTOR}.recompute_num_layers=2"],
     "selective takes no recompute_num_layers"),
    ([f"+{ACTOR}.recompute_granularity=partial"], f"{ACTOR}.recompute_granularity=partial: must be full, selective"),
    ([f"+{ACTOR}.recompute_granularity=full", f"+{ACTOR}.recompute_method=uniform", f"+{ACTOR}.recompute_num_layers=0"],
     f"{ACTOR}.recompute_num_layers=0: must be a positive integer"),
    ([f"+{ACTOR}.recompute_modules=core_attn"], f"{ACTOR}.recompute_modules=core_attn: must be a list"),
])
def test_recompute_values_are_checked(overrides, expected):
    assert expected in fails(*overrides)


def test_layout_and_dtype_names_may_repeat_megarls_keys_but_not_differ():
    ok(f"+{ACTOR}.tensor_model_parallel_size=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
       "trainer.n_gpus_per_node=8", f"+{ACTOR}.bf16=true")
    msg = fails(f"+{ACTOR}.tensor_model_parallel_size=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "trainer.n_gpus_per_node=8")
    assert (f"{ACTOR}.tensor_model_parallel_size=4 conflicts with "
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2") in msg
    assert f"{ACTOR}.fp16=True conflicts with actor_rollout_ref.model.dtype=bfloat16" in fails(f"+{ACTOR}.fp16=true")
    assert f"{ACTOR}.params_dtype=float32 conflicts with actor_rollout_ref.model.dtype" in fails(
        f"+{ACTOR}.params_dtype=float32")


@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model"])
def test_uneven_pipeline_stages_load_by_first_and_last_stage_only(role):
    """verl's Qwen3-235B-A22B example sets num_layers_in_first/last_pipeline_stage in this dict: they
    load at PP > 1 (the engine checks them against the model's layers); not at PP 1, not as anything
    but a positive integer; megatron's other ways of cutting stages are refused naming the key."""
    key = f"{role}.megatron.override_transformer_config"
    layout = [f"{role}.megatron.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=8"]
    enable = {"critic": ["critic.enable=true"], "reward_model": ["reward_model.enable=true",
                                                                 "reward_model.model.path=/models/rm"]}.get(role, [])
    ok(*layout, *enable, f"+{key}.num_layers_in_first_pipeline_stage=3", f"+{key}.num_layers_in_last_pipeline_stage=1")
    assert f"{key}.num_layers_in_first_pipeline_stage=0: must be a positive integer or null" in fails(
        *layout, *enable, f"+{key}.num_layers_in_first_pipeline_stage=0")
    # megatron's account_for_embedding/loss_in_pipeline_split load (verl's Qwen3-VL-235B and DeepSeek-V3
    # examples), but not beside num_layers_in_first/last_pipeline_stage, which megatron-core's
    # TransformerConfig refuses (the oracle: its own ValueError)
    ok(*layout, *enable, f"+{key}.account_for_loss_in_pipeline_split=true",
       f"+{key}.account_for_embedding_in_pipeline_split=true")
    msg = fails(*layout, *enable, f"+{key}.num_layers_in_first_pipeline_stage=3",
                f"+{key}.account_for_loss_in_pipeline_split=true")
    assert (f"{key}: num_layers_in_first_pipeline_stage cannot be set together with "
            "account_for_loss_in_pipeline_split") in msg
    from megatron.core.transformer.transformer_config import TransformerConfig
    with pytest.raises(ValueError, match="cannot be"):
        TransformerConfig(num_layers=8, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=2,
                          num_layers_in_first_pipeline_stage=3, account_for_loss_in_pipeline_split=True,
                          pipeline_dtype=torch.float32)
    assert f"{key}.account_for_loss_in_pipeline_split=2: must be true or false" in fails(
        *layout, *enable, f"+{key}.account_for_loss_in_pipeline_split=2")
    assert f"{key}.pipeline_model_parallel_layout=Et|tL: megarl cuts uneven pipeline stages with" in fails(
        *layout, *enable, f"+{key}.pipeline_model_parallel_layout='Et|tL'")
    assert (f"{key}.num_layers_in_last_pipeline_stage=2 needs pipeline_model_parallel_size > 1" in
            fails(*enable, f"+{key}.num_layers_in_last_pipeline_stage=2"))
    ok(*layout, *enable, f"+{key}.num_layers_in_first_pipeline_stage=null",
       f"+{key}.account_for_embedding_in_pipeline_split=false")


def test_the_old_log_prob_pass_keys_default_to_the_actors_and_are_checked():
    config = ok("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=5000")
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu) == (True, 5000)
    config = ok("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=9000")
    rollout, actor = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    assert (rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu) == (True, 9000)
    assert (actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu) == (False, 16384)  # the update's stay apart
    msg = fails("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=100")
    assert "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=100 tokens is less than one full sequence" in msg
    # the actor's too-small budget, inherited by the pass, is reported once, under the actor's key
    msg = fails("actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100")
    assert msg.count("tokens is less than one full sequence") == 1
    assert "log_prob_max_token_len_per_gpu=0: must be a positive integer" in fails(
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=0")


def test_model_engine_megatron_is_accepted_and_another_engine_refused(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        ok("model_engine=megatron")
    assert any(r.getMessage().startswith("model_engine (verl key") for r in caplog.records)
    assert "model_engine=dp (override 'model_engine=dp'): megarl trains with Megatron only" in fails("model_engine=dp")
    (tmp_path / "exp.yaml").write_text("model_engine: veomni\n")
    with pytest.raises(ConfigError, match="model_engine=veomni .*megarl accepts model_engine=megatron only"):
        load_config(tmp_path / "exp.yaml", REQUIRED)


def test_cp_comm_type_takes_megatrons_names_and_not_the_hierarchical_one():
    for value in ("p2p", "all_gather", "a2a", "[p2p,a2a]"):
        ok("actor_rollout_ref.actor.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=2",
           f"+{ACTOR}.cp_comm_type={value}")
    assert f"{ACTOR}.cp_comm_type=ring: must be one of p2p, all_gather, a2a, a2a+p2p" in fails(
        f"+{ACTOR}.cp_comm_type=ring")
    assert f"{ACTOR}.cp_comm_type=a2a+p2p needs megatron's hierarchical context-parallel groups" in fails(
        f"+{ACTOR}.cp_comm_type=a2a+p2p")


@pytest.mark.parametrize("cp_comm_type, cp, tp, heads, groups, window, refused", [
    (None, 2, 1, 4, 2, False, None),  # p2p, the default
    ("a2a", 2, 1, 4, 2, False, None),  # 4 and 2 heads split over CP2
    ("a2a", 2, 2, 4, 2, False, "cp_comm_type=a2a"),  # 1 key/value head per TP rank cannot split over CP2
    ("a2a", 4, 1, 4, 2, False, "cp_comm_type=a2a"),
    (None, 2, 1, 4, 2, True, "cp_comm_type=p2p (the default)"),  # TE's p2p refuses a sliding window
    ("all_gather", 2, 1, 4, 2, True, None),
    (["a2a", "p2p"], 2, 1, 4, 2, True, "cp_comm_type=p2p"),
    ("a2a", 1, 2, 4, 2, True, None),  # no context parallelism: nothing to refuse
])
def test_cp_comm_type_combinations_transformer_engine_refuses(cp_comm_type, cp, tp, heads, groups, window, refused):
    problems = cp_comm_type_model_problems(ACTOR, cp_comm_type, cp=cp, tp=tp, heads=heads, query_groups=groups,
                                           sliding_window=window)
    if refused is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(f"{ACTOR}.{refused}")
