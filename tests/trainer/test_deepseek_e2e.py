"""A tiny DeepSeek-V3 (multi-latent attention, a dense first layer, sigmoid group-limited routing with
a nonzero selection bias, a shared expert) trained by GRPO on CPU with routing replay
(configs/tiny/grpo_moe.yaml): the CPU engine (HF's DeepseekV3ForCausalLM) records its routes, the
actor replays them, so step 1's ppo_kl is exactly 0; the weight push after step 1 lands in the CPU
engine under the names it checks (every pushed tensor compared), after which the rollout's transformers
log-probs of step 2 equal the actor's; the step-1 checkpoint exports, and transformers loads it.
(GLM-4.5, the same router on grouped-query attention: test_glm4_moe_e2e.py.)"""
import json
import sys
from pathlib import Path

import pytest

from sigmoid_moe import biased_tiny_model, check_two_replayed_steps, export_and_check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def test_deepseek_v3_grpo_with_routing_replay_trains_and_exports(tiny_assets, tmp_path, run_to_completion):
    model = tmp_path / "model"
    weights = biased_tiny_model("deepseek_v3", model)
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo_moe.yaml"),
           f"actor_rollout_ref.model.path={model}", f"data.train_files={tiny_assets / 'data/train.parquet'}",
           "data.val_files=[]", f"trainer.default_local_dir={tmp_path / 'runs'}",
           f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",  # gradients not all 0
           "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=false"]
    run_to_completion(cmd, tmp_path, 600, "DeepSeek-V3 GRPO experiment")
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "megarl-tiny" / "grpo_moe" / "logs" / "metrics.jsonl").read_text().splitlines()]
    check_two_replayed_steps([r for r in rows if "timing/step_s" in r], weights)
    export_and_check(tmp_path / "runs" / "megarl-tiny" / "grpo_moe" / "global_step_1", tmp_path / "hf", weights)
