"""A tiny gpt-oss (attention sinks, alternating sliding windows, biases on every linear, the clamped
SwiGLU, YaRN, experts fused on disk) trained by GRPO on CPU with routing replay
(configs/tiny/grpo_moe.yaml): the CPU engine (HF's GptOssForCausalLM) records its routes, the actor
replays them, so step 1's ppo_kl is exactly 0; the weight push after step 1 sends the experts as
the four fused tensors of all experts per layer (the names SGLang's GptOssForCausalLM loads) and
lands in the CPU engine under those names (every pushed tensor compared), after which the rollout's
transformers log-probs of step 2 equal the actor's; the step-2 checkpoint exports to the HF names, and after
the last push the CPU engine's log-probs equal transformers' own on that export."""
import pytest
from safetensors.torch import load_file

from megarl.cli import main as megarl_main
from megarl.data.tiny_model import make_tiny_model
from sigmoid_moe import check_engine_is_the_export, check_two_replayed_steps, grpo_two_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_gpt_oss_grpo_with_routing_replay_pushes_fused_experts_and_exports(tiny_assets, tmp_path, ray_two_gpus):
    model = make_tiny_model("gpt_oss", tmp_path / "model", layers=2, hidden=64, heads=4, kv_heads=2,
                            intermediate=32, tie=False, seed=0)
    weights = load_file(model / "model.safetensors")
    assert "model.layers.1.mlp.experts.gate_up_proj" in weights  # transformers saves the experts fused
    train, engine, checkpoint = grpo_two_steps(model, tiny_assets, tmp_path)
    check_two_replayed_steps(train, weights)  # every HF tensor pushed under its checkpoint name and compared
    export = tmp_path / "hf"
    assert megarl_main(["export", str(checkpoint), "--out", str(export)]) == 0
    exported = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == weights.keys()  # the fused names, as transformers writes them
    assert all(exported[n].shape == weights[n].shape for n in weights)
    check_engine_is_the_export(engine, export, model)
