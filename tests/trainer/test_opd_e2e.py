"""On-policy distillation end to end on CPU (configs/tiny/opd.yaml): `python -m megarl.trainer.main_ppo`
with a Megatron teacher on the actor's logical GPU, and with an SGLang teacher (a CPU-engine server
started here once for this module's SGLang-teacher runs, stopped by its PID). The teacher is the tiny
model's architecture with other weights (seed 1) and the same character tokenizer; pure OPD, one
response per prompt, two steps (the second after an update), sampled at temperature 0.7: the reverse
KL is at OPD's temperature (1) on both sides all the same (megarl.algos.opd), which takes the student a
pass of its own."""
import json
import math
import sys
from pathlib import Path

import pytest

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout.launch import cpu_server_command
from megarl.rollout.process import ServerProcess, start_on_a_free_port

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
ROLLOUT_TEMPERATURE = 0.7

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def teacher(tiny_assets, tmp_path_factory) -> Path:
    return make_tiny_model("qwen2", tmp_path_factory.mktemp("teacher") / "model", seed=1)


def train_rows(run_to_completion, tiny_assets: Path, teacher: Path, out: Path, steps: int, *overrides: str) -> list[dict]:
    """The logged training steps of configs/tiny/opd.yaml run for `steps` steps."""
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/opd.yaml"),
           f"actor_rollout_ref.model.path={tiny_assets / 'model'}", f"distillation.teacher.model_path={teacher}",
           f"data.train_files={tiny_assets / 'data/train.parquet'}",
           f"data.val_files={tiny_assets / 'data/val.parquet'}",
           f"trainer.default_local_dir={out}", f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.logger=[console]",
           f"actor_rollout_ref.rollout.temperature={ROLLOUT_TEMPERATURE}", *overrides]
    run_to_completion(cmd, out, 400, "OPD experiment")
    logs = out / "megarl-tiny" / "opd" / "logs"
    rows = [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "timing/step_s" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    return train


def run_opd(run_to_completion, tiny_assets: Path, teacher: Path, out: Path, *overrides: str) -> list[dict]:
    train = train_rows(run_to_completion, tiny_assets, teacher, out, STEPS, *overrides)
    for row in train:
        assert row["timing/teacher_log_prob_s"] > 0 and row["timing/old_log_prob_s"] > 0  # both before the advantages
        assert row["timing/opd_student_log_prob_s"] > 0  # the student at OPD's temperature, not the rollout's
        assert row["opd/coverage"] == 1.0
        assert math.isfinite(row["opd/reverse_kl_mean"]) and row["opd/teacher_log_prob_mean"] < 0
        assert row["rollout/samples"] == 8  # 8 prompts x n=1
        # pure OPD: the advantage is -kl_coef x the reverse KL, whose mean over tokens is logged
        assert row["advantages/mean"] == pytest.approx(-row["opd/reverse_kl_mean"], abs=1e-5)
    return train


@pytest.fixture(scope="module")
def teacher_server(teacher, tmp_path_factory) -> ServerProcess:
    """The teacher served by a CPU-engine server, for every SGLang-teacher run here (the server keeps
    no state between requests); stopped by its PID at the module's end."""
    out = tmp_path_factory.mktemp("teacher_server")

    def server_on(port):
        return ServerProcess("teacher", cpu_server_command(str(teacher), port, num_threads=1),
                             f"http://127.0.0.1:{port}", log_path=str(out / "teacher.log"), startup_timeout_s=120)

    server = start_on_a_free_port(server_on, "127.0.0.1")
    yield server
    server.stop(timeout_s=15)


@pytest.fixture(scope="module")
def megatron_run(tiny_assets, teacher, tmp_path_factory, run_to_completion):
    return run_opd(run_to_completion, tiny_assets, teacher, tmp_path_factory.mktemp("opd_megatron"))


@pytest.fixture(scope="module")
def sglang_run(tiny_assets, teacher, teacher_server, tmp_path_factory, run_to_completion):
    return run_opd(run_to_completion, tiny_assets, teacher, tmp_path_factory.mktemp("opd_sglang"),
                   "distillation.type=sglang", f"distillation.teacher.url={teacher_server.url}")


def test_megatron_teacher(megatron_run):
    assert all(r["opd/reverse_kl_mean"] != 0 for r in megatron_run)  # another model: the signal is not empty


def test_sglang_teacher_server(sglang_run):
    assert all(r["opd/reverse_kl_mean"] != 0 for r in sglang_run)


def test_both_teachers_score_the_first_step_alike(megatron_run, sglang_run):
    """Step 1 samples the same responses in both runs (the same seeds, the same start): the
    Megatron teacher's forward and the server's input log-probs give the same signal, both at OPD's
    temperature (an SGLang server's input log-probs are at 1 whatever the request says)."""
    for key in ("opd/teacher_log_prob_mean", "opd/reverse_kl_mean"):
        assert megatron_run[0][key] == pytest.approx(sglang_run[0][key], abs=1e-4), key


TOPK = ("distillation.loss_mode=forward_kl_topk", "distillation.use_policy_gradient=false", "distillation.topk=8",
        "distillation.loss_max_clamp=10.0", "distillation.log_prob_min_clamp=-10.0")


@pytest.fixture(scope="module")
def topk_megatron_run(tiny_assets, teacher, tmp_path_factory, run_to_completion):
    return train_rows(run_to_completion, tiny_assets, teacher, tmp_path_factory.mktemp("topk_megatron"), 2, *TOPK)


def test_forward_kl_topk_trains_on_the_distillation_loss_alone(topk_megatron_run):
    """verl's run_qwen3_8b_megatron.sh loss (forward_kl_topk over the teacher's top 8, directly,
    without task rewards, both clamps), two steps: one response per prompt leaves GRPO's advantage 0,
    so the update's gradient is the distillation term's alone, and the advantage carries no OPD term.
    The loss against HF's models: tests/engines/test_distillation_engine.py."""
    for row in topk_megatron_run:
        assert row["timing/teacher_log_prob_s"] > 0 and row["opd/coverage"] == 1.0
        assert 0 < row["actor/distillation_loss"] < 10.0 and math.isfinite(row["actor/distillation_loss"])
        assert row["advantages/mean"] == 0.0
        assert row["actor/grad_norm"] > 0


def test_forward_kl_topk_from_an_sglang_teacher_matches_the_megatron_teachers_first_step(
        topk_megatron_run, tiny_assets, teacher, teacher_server, tmp_path, run_to_completion):
    """The same loss with the teacher behind a server (`RolloutClient.score_top_k`, SGLang's
    `top_logprobs_num`), one step: the same responses as the Megatron teacher's run's step 1, and the
    same top-k from the server's input top log-probs as from the Megatron head, so the same loss."""
    (row,) = train_rows(run_to_completion, tiny_assets, teacher, tmp_path, 1, *TOPK,
                        "distillation.type=sglang", f"distillation.teacher.url={teacher_server.url}")
    assert row["opd/coverage"] == 1.0 and row["actor/grad_norm"] > 0
    for key in ("actor/distillation_loss", "opd/teacher_log_prob_mean"):
        assert row[key] == pytest.approx(topk_megatron_run[0][key], abs=1e-4), key
