"""verl's QAT keys (engine/megatron.yaml `qat`) as megarl reads them: what is refused naming its key (w4a4,
another group size, QAT with LoRA, FP8 training or grouped-GEMM experts, the critic's QAT), what is warned
about (an activation observer with w4a16, which verl ignores; the reward model's QAT; the push's format), the quantization config JSON the preflight reads (verl-recipe's
qat/config/nvfp4_w4a16_megatron.json, its content below), and verl-recipe's --config-name=dapo_qat_megatron_trainer."""
import json
import logging

import pytest

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.rules.qat import quantization_config_problems, rollout_weights_format

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
QAT = "actor_rollout_ref.actor.megatron.qat"
# verl-recipe qat/config/nvfp4_w4a16_megatron.json (verl-project/verl-recipe)
RECIPE_JSON = {
    "quant_method": "modelopt",
    "config_groups": {"group_0": {
        "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
        "targets": ["Linear"]}},
    "ignore": ["lm_head"], "quant_algo": "NVFP4", "producer": {"name": "modelopt"}}


def test_verls_qat_keys_are_accepted_with_verls_defaults(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(None, REQUIRED + [f"{QAT}.enable=true", f"{QAT}.mode=w4a16"])
    qat = config.actor_rollout_ref.actor.megatron.qat
    assert qat.enable and qat.group_size == 16 and qat.ignore_patterns == ["lm_head", "*mlp.gate"]
    assert rollout_weights_format() == "dequantized"
    assert any("without NVFP4's memory and speed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("overrides, message", [
    ([f"{QAT}.mode=w4a4"], f"{QAT}.mode=w4a4: not built"),
    ([f"{QAT}.group_size=32"], f"{QAT}.group_size=32: NVFP4 requires 16"),
    (["actor_rollout_ref.model.lora.rank=8"], f"{QAT}.enable=true with actor_rollout_ref.model.lora.rank=8: not built"),
    (["+actor_rollout_ref.actor.megatron.override_transformer_config.fp8=hybrid"],
     "override_transformer_config.fp8=hybrid: QAT builds megatron's local linear layers"),
    (["actor_rollout_ref.actor.megatron.moe_grouped_gemm=true"], "moe_grouped_gemm=true: QAT quantizes"),
])
def test_what_is_not_built_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as raised:
        load_and_validate(None, REQUIRED + [f"{QAT}.enable=true", *overrides])
    assert message in str(raised.value)


def test_the_critics_qat_is_refused_and_the_reward_models_warned_about(caplog):
    with pytest.raises(ConfigError, match="critic.megatron.qat.enable=true: quantization-aware training of the critic"):
        load_and_validate(None, REQUIRED + ["critic.megatron.qat.enable=true"])
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        load_and_validate(None, REQUIRED + ["reward_model.megatron.qat.enable=true"])
    assert any("reward_model.megatron.qat.enable=true has no effect" in r.getMessage() for r in caplog.records)


def test_an_activation_observer_with_w4a16_is_warned_about_as_verl_ignores_it(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        load_and_validate(None, REQUIRED + [f"{QAT}.enable=true", f"{QAT}.activation_observer=static_minmax"])
    assert any(f"{QAT}.activation_observer=static_minmax has no effect with mode=w4a16" in r.getMessage()
               for r in caplog.records)


def test_gradient_accumulation_fusion_is_left_out_with_a_warning(caplog):
    from megarl.engines.megatron.qat import transformer_overrides

    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        load_and_validate(None, REQUIRED + [
            f"{QAT}.enable=true", "+actor_rollout_ref.actor.megatron.override_transformer_config."
                                  "gradient_accumulation_fusion=true"])
    assert any("gradient_accumulation_fusion=true is left out" in r.getMessage() for r in caplog.records)
    assert transformer_overrides({"gradient_accumulation_fusion": True, "recompute_num_layers": 1}) == {
        "recompute_num_layers": 1}


def test_the_quantization_config_file_is_read_and_checked(tmp_path):
    def problems(content=None, name="q.json", **qat):
        path = tmp_path / name
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        overrides = [f"{QAT}.enable=true", f"{QAT}.quantization_config_path={path}"]
        return quantization_config_problems(load_config(None, REQUIRED + overrides))

    assert problems(RECIPE_JSON) == []
    assert problems(name="missing.json") == [f"{QAT}.quantization_config_path={tmp_path}/missing.json: no such file"]
    assert "not a readable JSON file" in problems("{not json", name="bad.json")[0]
    assert "quant_algo is 'FP8', not \"NVFP4\"" in problems({**RECIPE_JSON, "quant_algo": "FP8"}, name="fp8.json")[0]
    group32 = json.loads(json.dumps(RECIPE_JSON))
    group32["config_groups"]["group_0"]["weights"]["group_size"] = 32
    assert "config_groups.group_0.weights" in problems(group32, name="g32.json")[0]
    # QAT off: the key is not read
    off = load_config(None, REQUIRED + [f"{QAT}.quantization_config_path={tmp_path}/missing.json"])
    assert quantization_config_problems(off) == []


def test_verl_recipes_qat_config_name_loads_its_defaults(tmp_path, monkeypatch, caplog):
    from megarl.config.args import experiment_file
    from megarl.trainer.main_ppo import build_parser

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_intermixed_args(["--config-path=recipe/qat/config",
                                                 "--config-name=dapo_qat_megatron_trainer", *REQUIRED,
                                                 f'{QAT}.ignore_patterns=["lm_head", "*mlp.gate", "*self_attn*"]'])
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(experiment_file(args), args.overrides)
    qat = config.actor_rollout_ref.actor.megatron.qat
    assert qat.enable and qat.mode == "w4a16" and qat.ignore_patterns == ["lm_head", "*mlp.gate", "*self_attn*"]
    assert config.reward_model.reward_manager == "dapo" and config.trainer.project_name == "verl-dapo-qat"
    # what the actor's engine is built with (the reference's, forward-only, is never quantized: test_qat.py)
    from megarl.engines.megatron.roles import qat_spec

    assert qat_spec(qat).ignore_patterns == ("lm_head", "*mlp.gate", "*self_attn*")
    assert sum("dapo_qat_megatron_trainer" in r.getMessage() for r in caplog.records) == 1
