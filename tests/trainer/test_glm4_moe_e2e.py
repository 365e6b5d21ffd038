"""A tiny GLM-4.5 (glm4_moe: grouped-query attention with q/k/v biases and q/k norms, rotary on half of
each head, a dense first layer, DeepSeek-V3's sigmoid group-limited router with a nonzero selection bias
and a shared expert) trained by GRPO on CPU with routing replay (configs/tiny/grpo_moe.yaml), the
trainer in this process: step 1's ppo_kl is exactly 0 (a separate old-log-prob pass replaying the CPU
engine's routes), every pushed tensor is compared in the CPU engine (HF's Glm4MoeForCausalLM), step 2's
rollout log-probs equal the actor's, and after step 2's push the CPU engine's log-probs of a sequence
equal transformers' own on the step-2 checkpoint's HF export.

The push names are SGLang's: SGLang 0.5.23's `Glm4MoeForCausalLM.load_weights` (srt/models/glm4_moe.py)
takes the hub checkpoint's names (q/k/v_proj into qkv_proj, gate/up_proj into gate_up_proj, each
`mlp.experts.<e>.{gate,up,down}_proj.weight` into the fused experts, the rest by name: `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.shared_experts.*`, q/k norms and biases) and skips any other name
without a word; the push is checked to send exactly the starting checkpoint's names but the selection
bias, which SGLang holds from the checkpoint and megarl never moves. (DeepSeek-V3: test_deepseek_e2e.py.)"""
import pytest

from sigmoid_moe import (biased_tiny_model, check_engine_is_the_export, check_two_replayed_steps, export_and_check,
                         grpo_two_steps)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_glm4_moe_grpo_with_routing_replay_pushes_sglangs_names_and_exports_the_engines_model(
        tiny_assets, tmp_path, ray_two_gpus):
    from megarl.bridge import arch_from_hf_config, load_hf_config
    from megarl.bridge.mapping import WeightMap

    model = tmp_path / "model"
    weights = biased_tiny_model("glm4_moe", model, kv_heads=2)
    # the bridge's HF names, those the push sends (all but the selection bias: check_two_replayed_steps
    # counts them), are the checkpoint's: the names SGLang's loader takes
    assert sorted(WeightMap(arch_from_hf_config(load_hf_config(model)), 128).hf_names()) == sorted(weights)
    train, engine, checkpoint = grpo_two_steps(model, tiny_assets, tmp_path)
    check_two_replayed_steps(train, weights)
    export_and_check(checkpoint, tmp_path / "hf", weights)
    check_engine_is_the_export(engine, tmp_path / "hf", model)
