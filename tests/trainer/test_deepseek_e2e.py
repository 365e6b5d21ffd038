"""A tiny DeepSeek-V3 (multi-latent attention, a dense first layer, sigmoid group-limited routing with
a nonzero selection bias, a shared expert) trained by GRPO on CPU with routing replay
(configs/tiny/grpo_moe.yaml): the CPU engine (HF's DeepseekV3ForCausalLM) records its routes, the
actor replays them, so step 1's ppo_kl is exactly 0; the weight push after step 1 lands in the CPU
engine under the names it checks (every pushed tensor compared), after which the rollout's transformers
log-probs of step 2 equal the actor's; the step-1 checkpoint exports, and transformers loads it."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.bridge.safetensors_io import HFCheckpointReader
from megarl.cli import main as megarl_main
from megarl.data.tiny_model import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def test_deepseek_v3_grpo_with_routing_replay_trains_and_exports(tiny_assets, tmp_path, run_to_completion):
    model = make_tiny_model("deepseek_v3", tmp_path / "model", layers=2, hidden=64, heads=4, kv_heads=4,
                            intermediate=32, tie=False, seed=0)
    weights = load_file(model / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith("e_score_correction_bias")]:  # HF initialises it to 0
        weights[name] = 0.1 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo_moe.yaml"),
           f"actor_rollout_ref.model.path={model}", f"data.train_files={tiny_assets / 'data/train.parquet'}",
           "data.val_files=[]", f"trainer.default_local_dir={tmp_path / 'runs'}",
           f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",  # gradients not all 0
           "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=false"]
    run_to_completion(cmd, tmp_path, 600, "DeepSeek-V3 GRPO experiment")
    rows = [json.loads(line) for line in
            (tmp_path / "runs" / "megarl-tiny" / "grpo_moe" / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["actor/ppo_kl"] == 0.0 and train[0]["actor/grad_norm"] > 0
    # every pushed tensor equals the CPU engine's (its HF names); the bias is a buffer, never trained, never pushed
    pushed = [n for n in weights if not n.endswith("e_score_correction_bias")]
    assert train[0]["sync/checked_tensors"] == len(pushed)
    # step 2 rolled out on the pushed weights: transformers' log-probs there equal the replaying actor's
    assert train[1]["training/rollout_log_probs_diff_max"] < 1e-5
    export = tmp_path / "hf"
    assert megarl_main(["export", str(tmp_path / "runs" / "megarl-tiny" / "grpo_moe" / "global_step_1"),
                        "--out", str(export)]) == 0
    with HFCheckpointReader(export) as reader:
        exported = {name: reader.read(name) for name in reader.names()}
    assert exported.keys() == weights.keys()
    for name in [n for n in weights if n.endswith("e_score_correction_bias")]:
        assert torch.equal(exported[name], weights[name]), name  # megarl never moves the selection bias
    assert any(not torch.equal(exported[n], weights[n]) for n in pushed)  # trained
