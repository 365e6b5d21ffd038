"""A tiny DeepSeek-V3 (multi-latent attention, a dense first layer, sigmoid group-limited routing with
a nonzero selection bias, a shared expert) trained by GRPO on CPU with routing replay
(configs/tiny/grpo_moe.yaml): the CPU engine (HF's DeepseekV3ForCausalLM) records its routes, the
actor replays them, so step 1's ppo_kl is exactly 0; the weight push after step 1 lands in the CPU
engine under the names it checks (every pushed tensor compared), after which the rollout's transformers
log-probs of step 2 equal the actor's; the step-1 checkpoint exports, and transformers loads it.
(GLM-4.5, the same router on grouped-query attention: test_glm4_moe_e2e.py.)"""
import pytest

from sigmoid_moe import biased_tiny_model, check_two_replayed_steps, export_and_check, grpo_two_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_deepseek_v3_grpo_with_routing_replay_trains_and_exports(tiny_assets, tmp_path, run_to_completion):
    model = tmp_path / "model"
    weights = biased_tiny_model("deepseek_v3", model)
    train, run = grpo_two_steps(model, tiny_assets, tmp_path, run_to_completion, "DeepSeek-V3 GRPO experiment")
    check_two_replayed_steps(train, weights)
    export_and_check(run / "global_step_1", tmp_path / "hf", weights)
