"""A tiny gpt-oss (attention sinks, alternating sliding windows, biases on every linear, the clamped
SwiGLU, YaRN, experts fused on disk) trained by GRPO on CPU with routing replay
(configs/tiny/grpo_moe.yaml): the CPU engine (HF's GptOssForCausalLM) records its routes, the actor
replays them, so step 1's ppo_kl is exactly 0; the weight push after step 1 sends the experts as
the four fused tensors of all experts per layer (the names SGLang's GptOssForCausalLM loads) and
lands in the CPU engine under those names (every pushed tensor compared), after which the rollout's
transformers log-probs of step 2 equal the actor's; the step-1 checkpoint exports to the HF names."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megarl.cli import main as megarl_main
from megarl.data.tiny_model import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def test_gpt_oss_grpo_with_routing_replay_pushes_fused_experts_and_exports(tiny_assets, tmp_path, run_to_completion):
    model = make_tiny_model("gpt_oss", tmp_path / "model", layers=2, hidden=64, heads=4, kv_heads=2,
                            intermediate=32, tie=False, seed=0)
    weights = load_file(model / "model.safetensors")
    assert "model.layers.1.mlp.experts.gate_up_proj" in weights  # transformers saves the experts fused
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo_moe.yaml"),
           f"actor_rollout_ref.model.path={model}", f"data.train_files={tiny_assets / 'data/train.parquet'}",
           "data.val_files=[]", f"trainer.default_local_dir={tmp_path / 'runs'}",
           f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",  # gradients not all 0
           "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=false"]
    run_to_completion(cmd, tmp_path, 600, "gpt-oss GRPO experiment")
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "megarl-tiny" / "grpo_moe" / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["actor/ppo_kl"] == 0.0 and train[0]["actor/grad_norm"] > 0
    # every HF tensor was pushed under its checkpoint name and equals the CPU engine's
    assert train[0]["sync/checked_tensors"] == len(weights)
    # step 2 rolled out on the pushed weights: transformers' log-probs there equal the replaying actor's
    assert train[1]["training/rollout_log_probs_diff_max"] < 1e-5
    export = tmp_path / "hf"
    assert megarl_main(["export", str(tmp_path / "runs" / "megarl-tiny" / "grpo_moe" / "global_step_1"),
                        "--out", str(export)]) == 0
    exported = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == weights.keys()  # the fused names, as transformers writes them
    assert all(exported[n].shape == weights[n].shape for n in weights)
    assert any(not torch.equal(exported[n], weights[n]) for n in weights)  # trained
