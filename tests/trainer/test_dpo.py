"""DPO end to end on CPU: `python -m megarl.trainer.main_dpo` with the tiny model, policy and frozen
reference on the Megatron engine (configs/tiny/dpo.yaml's layout: TP=1 on one logical GPU) placed by
Ray.

The run trains 4 steps on the same 32 synthetic pairs (the whole training set each step), so the
reward margin on those pairs can be followed step by step and the reference's log-probs of them
must repeat exactly. Its numbers are checked against an HF transformers computation on the same
weights and pairs.

It saves a checkpoint every 2 steps and at the last (verl's trainer.save_freq, megarl.trainer.offline).
A run whose experiment directory holds only its checkpoint of step 2 (what a run stopped after it
leaves; resume_mode=auto finds it) trains steps 3 and 4 alone and ends exactly as the uninterrupted
run: their losses, gradient norms and the reference's log-probs (the frozen reference is rebuilt from
the model path, not saved), the validation at step 4, and the exported weights, bit for bit (Adam's
moments and the LR schedule come back).
"""
import itertools
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.algos.dpo import dpo_loss
from megarl.data.preferences import PreferenceDataset
from megarl.data.synthetic import write_task_dataset
from megarl.data.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 400
PAIRS, BETA, STEPS = 32, 0.1, 4

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_dpo")
    make_tiny_model("qwen2", root / "model", seed=0)
    write_task_dataset("add", root / "data", train_size=16, val_size=16, sft_size=0, pref_size=PAIRS, seed=0)
    return root


def dpo_command(tiny: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "megarl.trainer.main_dpo", "--config", str(REPO / "configs/tiny/dpo.yaml"),
           f"actor_rollout_ref.model.path={tiny / 'model'}", f"data.train_files={tiny / 'data/prefs_train.parquet'}",
           f"data.val_files={tiny / 'data/prefs_val.parquet'}", f"trainer.default_local_dir={out}",
           f"data.train_batch_size={PAIRS}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PAIRS}",
           "data.shuffle=false", f"algorithm.dpo.beta={BETA}", f"trainer.total_training_steps={STEPS}",
           "trainer.test_freq=2", "trainer.save_freq=2"]


def metrics_rows(out: Path) -> list[dict]:
    logs = out / "megarl-tiny" / "dpo" / "logs"
    return [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory, run_to_completion) -> tuple[list[dict], Path]:
    """(metrics.jsonl rows, output root) of one DPO run."""
    out = tmp_path_factory.mktemp("dpo_run")
    run_to_completion(dpo_command(tiny, out), out, TIMEOUT_S, "DPO run")
    return metrics_rows(out), out


@pytest.fixture(scope="module")
def resumed(tiny, run, tmp_path_factory, run_to_completion) -> tuple[list[dict], Path, str]:
    """(metrics.jsonl rows, output root, console output) of the run resumed from `run`'s step 2."""
    _, full = run
    out = tmp_path_factory.mktemp("dpo_resumed")
    step_2 = Path("megarl-tiny") / "dpo" / "global_step_2"
    shutil.copytree(full / step_2, out / step_2)
    output = run_to_completion(dpo_command(tiny, out), out, TIMEOUT_S, "resumed DPO run")
    return metrics_rows(out), out, output


def hf_sequence_log_probs(model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """([P], [P]) sums of the chosen and of the rejected responses' token log-probs under `model`."""
    def total(prompt, response):
        ids = torch.tensor([prompt + response])
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
        return log_probs.gather(1, torch.tensor(response)[:, None]).sum()

    chosen = torch.stack([total(p.prompt_ids, p.chosen_ids) for p in pairs])
    rejected = torch.stack([total(p.prompt_ids, p.rejected_ids) for p in pairs])
    return chosen, rejected


def test_dpo_run(tiny, run):
    rows, out = run
    for row in rows:
        for key, value in row.items():
            assert math.isfinite(value), f"step {row['step']}: {key}={value}"
    train = [r for r in rows if "dpo/loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for row in train:
        for key in ("dpo/reward_margin", "dpo/reward_accuracy", "dpo/rewards_chosen", "dpo/rewards_rejected",
                    "dpo/grad_norm", "dpo/lr", "timing/ref_log_prob_s", "timing/update_actor_s", "timing/step_s"):
            assert key in row, key
        assert row["dpo/lr"] > 0 and row["dpo/grad_norm"] > 0

    # step 0: the policy is the reference, so the loss is log 2 and every reward 0, exactly
    first = train[0]
    assert abs(first["dpo/loss"] - math.log(2)) < 1e-6
    assert first["dpo/reward_margin"] == 0.0 and first["dpo/rewards_chosen"] == 0.0
    assert first["dpo/logps_chosen"] == first["dpo/ref_logps_chosen"]
    assert rows[0]["step"] == 0 and abs(rows[0]["val/dpo_loss"] - math.log(2)) < 1e-6  # validation before training

    # learning: the margin on the training pairs grows every step, the loss falls
    margins = [r["dpo/reward_margin"] for r in train]
    assert all(b > a for a, b in itertools.pairwise(margins)), margins
    assert train[-1]["dpo/loss"] < math.log(2) and train[-1]["dpo/reward_accuracy"] > 0.5

    # the reference is frozen: its log-probs of the same pairs repeat exactly, on train and val
    for key in ("dpo/ref_logps_chosen", "dpo/ref_logps_rejected"):
        assert len({r[key] for r in train}) == 1, key
    validations = [r for r in rows if "val/dpo_loss" in r]
    assert [r["step"] for r in validations] == [0, 2, 4]
    assert len({r["val/dpo_ref_logps_chosen"] for r in validations}) == 1

    # the numbers are HF's: the same reference log-probs, and the first step's gradient norm
    model_dir = tiny / "model"
    pairs = PreferenceDataset(tiny / "data/prefs_train.parquet", AutoTokenizer.from_pretrained(model_dir),
                              max_prompt_length=16, max_response_length=8)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    chosen, rejected = hf_sequence_log_probs(reference, pairs)
    assert chosen.mean().item() == pytest.approx(first["dpo/ref_logps_chosen"], abs=1e-4)
    assert rejected.mean().item() == pytest.approx(first["dpo/ref_logps_rejected"], abs=1e-4)
    loss, _ = dpo_loss(chosen, rejected, chosen.detach(), rejected.detach(), beta=BETA)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in reference.parameters() if p.grad is not None))
    assert first["dpo/grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)

    # logs and the exported policy: it loads with transformers and prefers the chosen answers
    logs = out / "megarl-tiny" / "dpo" / "logs"
    events = EventAccumulator(str(logs / "tensorboard"))
    events.Reload()
    assert {"dpo/loss", "dpo/reward_margin", "val/dpo_loss"} <= set(events.Tags()["scalars"])
    trained = AutoModelForCausalLM.from_pretrained(out / "megarl-tiny" / "dpo" / "hf", dtype=torch.float32)
    with torch.no_grad():
        trained_chosen, trained_rejected = hf_sequence_log_probs(trained, pairs)
        margin = BETA * ((trained_chosen - chosen) - (trained_rejected - rejected)).mean().item()
    assert margin > margins[-1]  # after the 4th update, beyond the margin measured before it


def test_dpo_saves_every_save_freq_steps_and_at_the_last(run):
    _, out = run
    experiment = out / "megarl-tiny" / "dpo"
    assert sorted(p.name for p in experiment.glob("global_step_*")) == ["global_step_2", "global_step_4"]
    for step in (2, 4):
        directory = experiment / f"global_step_{step}"
        assert (directory / "COMPLETE").is_file()
        assert sorted(p.name for p in directory.iterdir() if p.is_dir()) == ["actor"]  # no reference
    assert (experiment / "latest").read_text().strip() == "global_step_4"


def test_a_dpo_run_resumed_from_step_2_ends_as_the_uninterrupted_run(run, resumed):
    rows, out = run
    again_rows, again_out, output = resumed
    assert "resumed from" in output and "(step 2)" in output
    train = {r["step"]: r for r in rows if "dpo/loss" in r}
    again = {r["step"]: r for r in again_rows if "dpo/loss" in r}
    assert sorted(again) == [3, 4]  # steps 1 and 2 are not trained again, nor validated before
    assert not [r for r in again_rows if r["step"] == 0]
    for step in (3, 4):
        for key in ("dpo/loss", "dpo/grad_norm", "dpo/lr", "dpo/reward_margin", "dpo/logps_chosen",
                    "dpo/ref_logps_chosen", "dpo/ref_logps_rejected"):
            assert again[step][key] == train[step][key], (step, key)  # bit for bit
    assert again[4]["val/dpo_loss"] == train[4]["val/dpo_loss"]
    exported = load_file(next((out / "megarl-tiny" / "dpo" / "hf").glob("*.safetensors")))
    exported_again = load_file(next((again_out / "megarl-tiny" / "dpo" / "hf").glob("*.safetensors")))
    assert exported.keys() == exported_again.keys()
    for name, tensor in exported.items():  # step 3's update needs step 2's Adam moments back, not fresh ones
        assert torch.equal(tensor, exported_again[name]), name
