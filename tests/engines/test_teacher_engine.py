"""On-policy distillation's Megatron teacher (`TeacherEngine`, a reference engine of its own model
and layout) on real megatron-core (CPU, gloo, 2 ranks; teacher_world.py): a llama teacher at TP2
and a qwen2 student at TP1 x DP2 from one config; each one's log-probs equal its own HF model's
(fp32) on the same ragged batch, and the two differ (two models)."""
import pytest
import torch
from engine_world import TEMPERATURE, hf_log_probs, ragged_batch
from teacher_world import teacher_world

from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world, two engines


@pytest.fixture(scope="module")
def run(tiny_models):
    return run_gloo_workers(teacher_world, 2, args=(tiny_models,), timeout_s=400)


def joined(run, role) -> torch.Tensor:
    parts = sorted((r[role]["dp_rank"], r[role]["scored"]) for r in run if r[role]["scored"] is not None)
    key = "teacher_log_probs" if role == "teacher" else "log_probs"
    return torch.cat([p[key] for _, p in parts])


def test_the_teacher_runs_at_its_own_layout(run):
    assert {(r["teacher"]["tp"], r["teacher"]["dp"]) for r in run} == {(2, 1)}
    assert {(r["student"]["tp"], r["student"]["dp"]) for r in run} == {(1, 2)}
    assert sum(r["teacher"]["scored"] is not None for r in run) == 1  # one output rank: TP rank 0


def test_teacher_and_student_log_probs_equal_their_hf_models(run, tiny_models):
    batch = ragged_batch(8)
    teacher, student = joined(run, "teacher"), joined(run, "student")
    torch.testing.assert_close(teacher, hf_log_probs(tiny_models["llama"], batch, TEMPERATURE), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(student, hf_log_probs(tiny_models["qwen2"], batch, TEMPERATURE), rtol=1e-5, atol=1e-5)
    padding = ~batch["response_mask"].bool()
    assert bool((teacher[padding] == 0).all())
    # negative control: the teacher is not the student (the reverse KL has something to measure)
    assert (teacher - student)[~padding].abs().max() > 0.1
