"""GRPO end to end with real SGLang 0.5.23 servers on the CPU: `python -m megarl.trainer.main_ppo` on
configs/tiny/grpo.yaml with `actor_rollout_ref.rollout.name=sglang`, its servers started by the rollout
workers from .venv-sglang, the real router in front, weights pushed over a gloo weight-update group
after every step. The exactness figures of the CPU-engine runs must hold with the real server:

- step 1's `ppo_kl` is exactly 0 with a separate old-log-prob pass (`old_log_probs_in_update=false`):
  the update's first pass recomputes, bit for bit, what the old-log-prob pass computed;
- the rollout's log-probs (SGLang's `output_token_logprobs`, fp32 server) equal the trainer's within
  1e-4 nats at every step, so also after a push (step 2 samples from the weights step 1 pushed).
"""
import json
import sys

import pytest

from megarl.data.synthetic import write_task_dataset
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_to_completion
from real_sglang import REPO, sglang_python

pytestmark = pytest.mark.slow


def test_grpo_with_real_sglang_is_exact(tmp_path):
    make_tiny_model("qwen2", tmp_path / "model", seed=0)
    write_task_dataset("add", tmp_path / "data", train_size=256, val_size=16, sft_size=0, seed=0)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo.yaml"),
           f"actor_rollout_ref.model.path={tmp_path / 'model'}", f"data.train_files={tmp_path / 'data/train.parquet'}",
           f"data.val_files={tmp_path / 'data/val.parquet'}", f"trainer.default_local_dir={out}",
           "actor_rollout_ref.rollout.name=sglang", f"actor_rollout_ref.rollout.server_python={sglang_python()}",
           "actor_rollout_ref.rollout.check_weight_update=false",  # per-tensor checksums: CPU engine only
           "actor_rollout_ref.actor.old_log_probs_in_update=false",  # a separate old-log-prob pass
           "actor_rollout_ref.actor.ppo_mini_batch_size=8"]  # one mini-batch: the first pass's ratio is 1
    run_to_completion(cmd, tmp_path, 600, "GRPO with real SGLang")
    logs = out / "megarl-tiny" / "grpo" / "logs"
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert train[0]["actor/ppo_kl"] == 0.0
    assert train[0]["actor/ratio_max"] == 1.0 and train[0]["actor/ratio_min"] == 1.0
    for row in train:
        assert row["timing/old_log_prob_s"] > 0  # the separate pass ran
        assert row["rollout/samples"] == 8 * 4 and row["sync/bytes"] > 0
        assert row["training/rollout_log_probs_diff_max"] < 1e-4, row["training/rollout_log_probs_diff_max"]
    assert [r["sync/weight_version"] for r in train] == [1.0, 2.0]
    assert "sglang.launch_server" in (logs / "rollout-0.log").read_text().splitlines()[0]  # the real server served
