"""Preemption and resume end to end on CPU: a run killed with SIGKILL while it writes a checkpoint,
and stopped with SIGTERM after a step, resumes and produces exactly the steps of an uninterrupted
run (the same batches, rewards, losses and gradient norms: sampling is seeded per prompt and the
engines' state is restored bit for bit)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM


pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # four runs of the trainer

STEPS = 3
# TP=2 on two logical GPUs with two servers (configs/tiny/grpo.yaml runs one): a sharded checkpoint,
# and seeded sampling that must repeat whichever server the router picks
ARGS = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.logger=[console]",
        f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}")
COMPARED = ("actor/", "reward/", "response_length/", "prompt_length/", "advantages/")
TIMEOUT_S = 400
REPO = Path(__file__).resolve().parents[2]


def start(tiny_dir: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo.yaml"),
           f"actor_rollout_ref.model.path={tiny_dir / 'model'}", f"data.train_files={tiny_dir / 'data/train.parquet'}",
           f"data.val_files={tiny_dir / 'data/val.parquet'}", f"trainer.default_local_dir={out}", *ARGS]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{proc.stdout.read()[-5000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {what} within {TIMEOUT_S} s")
        time.sleep(0.02)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the run did not stop within {TIMEOUT_S} s:\n{output[-5000:]}")
    return proc.returncode, output


def step_rows(out: Path) -> list[dict]:
    """Every training step's compared metrics, in the order logged (metrics.jsonl is appended to
    by every run: a step that was redone after a resume appears twice)."""
    path = out / "megarl-tiny" / "grpo" / "logs" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [{"step": r["step"], **{k: v for k, v in r.items() if k.startswith(COMPARED)}}
            for r in rows if "timing/step_s" in r]


def steps_logged(out: Path) -> dict[int, dict]:
    """The last logged metrics of each step."""
    return {r["step"]: r for r in step_rows(out)}


def test_sigkill_mid_checkpoint_then_sigterm_then_resume_matches_the_uninterrupted_run(tiny_assets, tmp_path):
    tiny = tiny_assets  # the tiny model and addition data (conftest.py)
    uninterrupted = tmp_path / "a"
    uninterrupted.mkdir()
    code, output = finish(start(tiny, uninterrupted))
    assert code == 0, output[-5000:]
    expected = steps_logged(uninterrupted)
    assert sorted(expected) == [1, 2, 3]
    assert all(expected[s]["actor/grad_norm"] > 0 for s in expected), "nothing to compare: no gradient"
    assert len({expected[s]["actor/pg_loss"] for s in expected}) == 3

    out = tmp_path / "b"
    out.mkdir()
    ckpts = out / "megarl-tiny" / "grpo"

    # 1. SIGKILL while the checkpoint of step 2 is being written: step 1's checkpoint is the one resumed.
    proc = start(tiny, out)
    wait_for(proc, lambda: any(ckpts.glob("global_step_2.tmp-*")), "the checkpoint write of step 2")
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc)
    assert (ckpts / "latest").read_text().strip() == "global_step_1"
    assert not (ckpts / "global_step_2").exists()

    # 2. Resumed from step 1; SIGTERM once it logged a step: it finishes the step it is in,
    #    checkpoints it and exits 75.
    proc = start(tiny, out)
    logged_before = len(step_rows(out))
    wait_for(proc, lambda: len(step_rows(out)) > logged_before, "a step after resuming")
    proc.send_signal(signal.SIGTERM)  # to the trainer alone, as the launchers do (Ray's daemons share its group)
    code, output = finish(proc)
    assert "global_step_1 at step 1" in output, output[-3000:]
    assert code == 75 and "stopped by SIGTERM" in output, output[-3000:]
    stopped_at = step_rows(out)[-1]["step"]
    assert (ckpts / "latest").read_text().strip() == f"global_step_{stopped_at}"

    # 3. Resumed from there, runs to the end.
    code, output = finish(start(tiny, out))
    assert code == 0 and f"global_step_{stopped_at} at step {stopped_at}" in output, output[-3000:]

    # The last checkpoint's actor exports as an HF model that transformers loads: trained weights.
    export = subprocess.run([sys.executable, "-m", "megarl.cli", "export", str(ckpts), "--out", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert export.returncode == 0, export.stderr[-3000:]
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    changed = [name for name, p in trained.named_parameters() if not torch.equal(p, initial.get_parameter(name))]
    assert changed and len(changed) == len(list(initial.parameters())), changed

    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, *range(2, STEPS + 1)]  # step 2 was redone after the SIGKILL
    for row in rows:
        assert row == expected[row["step"]], f"step {row['step']} differs"
