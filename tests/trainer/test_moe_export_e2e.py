"""A tiny Qwen3-MoE GRPO run on CPU (configs/tiny/grpo_moe.yaml: routing replay, the experts'
load-balancing loss) whose learning rate is too small to move any fp32 weight (1e-30: Adam's first
step moves each weight by about lr, far below half an ulp of any weight of this model), checkpointed
after its step, then `megarl export` given the run's `trainer.default_local_dir`: the export is the
starting HF checkpoint (its zeros made nonzero: a zero moves by lr) bit for bit, so every expert, router and norm made the round trip HF ->
engine (its torch_dist checkpoint) -> HF in its place. (The export of a trained MoE actor against the
engine's log-probs: tests/engines/test_moe_engine.py.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megarl.data.tiny_model import make_tiny_model
from megarl.bridge.safetensors_io import HFCheckpointReader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


def tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    with HFCheckpointReader(hf_dir) as reader:
        return {name: reader.read(name) for name in reader.names()}


def test_a_moe_run_that_moves_no_weight_exports_its_starting_checkpoint_bit_for_bit(tiny_assets, tmp_path):
    moe = make_tiny_model("qwen3_moe", tmp_path / "moe_model", seed=0, tie=False)
    # the padding token's embedding row is 0, which any step moves (to +-lr); give it a value
    weights = load_file(moe / "model.safetensors")
    weights = {n: torch.where(t == 0, torch.full_like(t, 1e-3), t) for n, t in weights.items()}
    save_file(weights, moe / "model.safetensors", metadata={"format": "pt"})
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo_moe.yaml"),
           f"actor_rollout_ref.model.path={moe}", f"data.train_files={tiny_assets / 'data/train.parquet'}",
           f"data.val_files={tiny_assets / 'data/val.parquet'}", f"trainer.default_local_dir={runs}",
           "trainer.total_training_steps=1", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.logger=[console]", "actor_rollout_ref.actor.optim.lr=1e-30"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (runs / "megarl-tiny" / "grpo_moe" / "global_step_1" / "COMPLETE").is_file()
    export = subprocess.run([sys.executable, "-m", "megarl.cli", "export", str(runs), "--out", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-3000:]
    start, exported = tensors(moe), tensors(tmp_path / "hf")
    assert exported.keys() == start.keys() and any(".mlp.experts.7.down_proj" in n for n in start)
    for name in start:
        assert exported[name].dtype == start[name].dtype and torch.equal(exported[name], start[name]), name
