"""The RL loop end to end on CPU: real megatron-core (TP=2 on gloo), CPU-engine rollout servers behind
the real sglang-router, Ray placement on logical GPUs, weight sync, TensorBoard logs. configs/tiny/grpo.yaml
runs one logical GPU (TP=1, one server); every test here sets the layout it covers (`TP2`).

Each run is `python -m megarl.trainer.main_ppo` in its own process session, killed as a group if it
overruns, and checked through the files it leaves: metrics.jsonl, TensorBoard events, the plot.
"""
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 400
TP2 = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")

pytestmark = pytest.mark.slow


def run_experiment(run_to_completion, tiny: Path, out: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo.yaml"),
           f"actor_rollout_ref.model.path={tiny / 'model'}", f"data.train_files={tiny / 'data/train.parquet'}",
           f"data.val_files={tiny / 'data/val.parquet'}", f"trainer.default_local_dir={out}", *overrides]
    run_to_completion(cmd, out, TIMEOUT_S, "experiment")
    logs = out / "megarl-tiny" / "grpo" / "logs"
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(logs / "tensorboard"))
    events.Reload()
    assert "reward/mean" in events.Tags()["scalars"]
    assert (logs / "curves.png").read_bytes()[:4] == b"\x89PNG"
    for row in rows:
        for key, value in row.items():
            assert math.isfinite(value), f"step {row['step']}: {key}={value}"
    return rows


# GRPO: the actor's update makes the old log-probs (no old_log_prob phase; actor.old_log_probs_in_update)
PHASES = ("generate", "reward", "advantages", "update_actor", "sync_weights")


def check_steps(rows: list[dict], steps: int, phases=PHASES) -> list[dict]:
    train = [r for r in rows if "timing/step_s" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for row in train:
        for phase in phases:
            assert row[f"timing/{phase}_s"] > 0, phase
        assert row["rollout/samples"] == 8 * 4
        assert row["sync/bytes"] > 0 and row["sync/buckets"] >= 1
        assert row["sync/checked_tensors"] > 0  # tiny/grpo.yaml: the servers' checksums equal the tensors sent
        assert row["actor/tokens"] > 0
        # balance_batch (on by default): the actor's one DP rank holds every prompt and response token
        assert row["global_seqlen/balanced_max"] == pytest.approx(row["throughput/tokens_per_s"] * row["timing/step_s"])
    assert "val/score" in rows[0] and rows[0]["step"] == 0  # validation before training
    assert "val/score" in train[-1]
    return train


def test_grpo_colocated(tiny_assets, tmp_path, run_to_completion):
    # TP=2 actor colocated with two servers behind the router.
    # One mini-batch per step: the update's first (only) pass sees ratio 1 exactly, so ppo_kl is 0.
    rows = run_experiment(run_to_completion, tiny_assets, tmp_path, *TP2, "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    train = check_steps(rows, 2)
    assert train[0]["actor/ppo_kl"] == 0.0
    assert train[0]["actor/ratio_max"] == 1.0 and train[0]["actor/ratio_min"] == 1.0
    for row in train:  # made inside the update, measured all the same
        assert "timing/old_log_prob_s" not in row and row["actor/entropy_before_update"] > 0


def test_grpo_split(tiny_assets, tmp_path, run_to_completion):
    # a TP=2 actor on 2 logical GPUs, two servers on the other 2
    rows = run_experiment(run_to_completion, tiny_assets, tmp_path, *TP2, "placement.mode=split", "placement.rollout_gpus=2",
                          "trainer.n_gpus_per_node=4")
    check_steps(rows, 2)


PPO = (*TP2, "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.gamma=1.0",
       "algorithm.lam=0.95", "critic.optim.lr=1e-3", "trainer.save_freq=1",
       # both roles' checkpoints written in the background (verl's fully async scripts' setting)
       "actor_rollout_ref.actor.checkpoint.async_save=true", "critic.checkpoint.async_save=true")


def test_ppo_with_critic_and_kl_in_reward(tiny_assets, tmp_path, run_to_completion):
    """A TP=2 actor and a DP=2 critic (the critic's layout is its own, TP=1 by default), two servers;
    both save in the background. A run resumed from the step 1 checkpoint trains step 2 exactly as
    the uninterrupted run: the background writes of the actor's and the critic's states (weights,
    optimizer, schedule) are whole."""
    (tmp_path / "a").mkdir()
    rows = run_experiment(run_to_completion, tiny_assets, tmp_path / "a", *PPO)
    # KL in the reward reads the old log-probs with the advantages: a pass of their own first
    train = check_steps(rows, 2, PHASES + ("old_log_prob", "ref_log_prob", "values", "update_critic"))
    for row in train:
        assert "critic/vf_loss" in row and "critic/kl" in row
    experiment = tmp_path / "a" / "megarl-tiny" / "grpo"
    for step in (1, 2):  # committed, each with both roles' parts
        assert (experiment / f"global_step_{step}" / "COMPLETE").is_file()
        assert all((experiment / f"global_step_{step}" / role / ".metadata").is_file() for role in ("actor", "critic"))
    resumed = tmp_path / "b" / "megarl-tiny" / "grpo"
    shutil.copytree(experiment / "global_step_1", resumed / "global_step_1")
    # the resumed run: step 2 alone, neither validated nor saved (its training metrics are what is compared)
    again = run_experiment(run_to_completion, tiny_assets, tmp_path / "b", *PPO, "trainer.val_before_train=false",
                           "trainer.test_freq=-1", "trainer.save_freq=-1")
    again = [r for r in again if "timing/step_s" in r]
    assert [r["step"] for r in again] == [2]
    compared = [k for k in train[1] if k.startswith(("actor/", "critic/", "reward/", "advantages/", "response_length/"))]
    assert "critic/vf_loss" in compared and "actor/grad_norm" in compared
    assert {k: again[0][k] for k in compared} == {k: train[1][k] for k in compared}  # bit for bit
