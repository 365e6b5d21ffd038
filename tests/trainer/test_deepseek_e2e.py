"""A tiny DeepSeek-V3 (multi-latent attention, a dense first layer, sigmoid group-limited routing with
a nonzero selection bias, a shared expert) trained by GRPO on CPU with routing replay
(configs/tiny/grpo_moe.yaml): the CPU engine (HF's DeepseekV3ForCausalLM) records its routes, the
actor replays them, so step 1's ppo_kl is exactly 0; the weight push after step 1 lands in the CPU
engine under the names it checks (every pushed tensor compared), after which the rollout's transformers
log-probs of step 2 equal the actor's; the step-2 checkpoint exports, and after the last push the CPU
engine's log-probs equal transformers' own on that export.
(GLM-4.5, the same router on grouped-query attention: test_glm4_moe_e2e.py.)"""
import pytest

from sigmoid_moe import (biased_tiny_model, check_engine_is_the_export, check_two_replayed_steps, export_and_check,
                         grpo_two_steps)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_deepseek_v3_grpo_with_routing_replay_trains_and_exports_the_engines_model(tiny_assets, tmp_path, ray_two_gpus):
    model = tmp_path / "model"
    weights = biased_tiny_model("deepseek_v3", model)
    train, engine, checkpoint = grpo_two_steps(model, tiny_assets, tmp_path)
    check_two_replayed_steps(train, weights)
    export_and_check(checkpoint, tmp_path / "hf", weights)
    check_engine_is_the_export(engine, tmp_path / "hf", model)
