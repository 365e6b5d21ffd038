"""What the end-to-end runs of the sigmoid-routed MoE families share (tests/trainer/test_deepseek_e2e.py,
test_glm4_moe_e2e.py): a tiny checkpoint whose routers' selection bias is nonzero, and the checks of a
2-step GRPO run with routing replay and of its exported step-1 checkpoint. `grpo_two_steps` (the run
itself, also gpt-oss's: test_gptoss_e2e.py)."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megarl.bridge.safetensors_io import HFCheckpointReader
from megarl.cli import main as megarl_main
from megarl.data.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
SELECTION_BIAS = "e_score_correction_bias"  # the router's `mlp.gate.e_score_correction_bias` [E]


def biased_tiny_model(family: str, out: Path, **shape) -> dict[str, torch.Tensor]:
    """A tiny `family` checkpoint (2 layers, hidden 64, 4 heads, experts 32 wide, untied) in `out`, its
    selection biases set to 0.1 N(0, 1) (HF initialises them to 0, which would hide a bias lost on the way);
    returns its tensors by HF name."""
    make_tiny_model(family, out, **{"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 4, "intermediate": 32,
                                    "tie": False, "seed": 0, **shape})
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in weights if n.endswith(SELECTION_BIAS)]:
        weights[name] = 0.1 * torch.randn(weights[name].shape, generator=g)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return weights


def check_two_replayed_steps(train: list[dict], weights: dict[str, torch.Tensor]) -> None:
    """`train`: the two steps' metrics. Step 1's PPO KL is exactly 0 (the old-log-prob pass replays the
    rollout's routes on the weights the update starts from) and its gradients are not all 0; the push after
    it put every trained tensor into the engine under its HF name, each compared there (the selection bias
    is a buffer: never trained, never pushed); step 2's rollout log-probs, on the pushed weights, equal the
    replaying actor's."""
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["actor/ppo_kl"] == 0.0 and train[0]["actor/grad_norm"] > 0
    assert train[0]["sync/checked_tensors"] == len([n for n in weights if not n.endswith(SELECTION_BIAS)])
    assert train[1]["training/rollout_log_probs_diff_max"] < 1e-5


def export_and_check(checkpoint: Path, out: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`megarl export` of `checkpoint` into `out`: the starting checkpoint's names, its selection biases
    unchanged (megarl never moves them), some tensor trained; returns the exported tensors."""
    assert megarl_main(["export", str(checkpoint), "--out", str(out)]) == 0
    with HFCheckpointReader(out) as reader:
        exported = {name: reader.read(name) for name in reader.names()}
    assert exported.keys() == weights.keys()
    for name in [n for n in weights if n.endswith(SELECTION_BIAS)]:
        assert torch.equal(exported[name], weights[name]), name
    assert any(not torch.equal(exported[n], weights[n]) for n in weights if not n.endswith(SELECTION_BIAS))
    return exported


def grpo_two_steps(model: Path, tiny_assets: Path, tmp_path: Path, run_to_completion, what: str) -> tuple[list[dict], Path]:
    """Two GRPO steps with routing replay of the tiny MoE checkpoint `model` (configs/tiny/grpo_moe.yaml, a
    reward whose gradients are not all 0, a checkpoint at each step), run to completion as a subprocess:
    (the training steps' metrics rows, the run's directory)."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo_moe.yaml"),
           f"actor_rollout_ref.model.path={model}", f"data.train_files={tiny_assets / 'data/train.parquet'}",
           "data.val_files=[]", f"trainer.default_local_dir={runs}",
           f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",
           "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=false"]
    run_to_completion(cmd, tmp_path, 600, what)
    run = runs / "megarl-tiny" / "grpo_moe"
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "timing/step_s" in r], run
