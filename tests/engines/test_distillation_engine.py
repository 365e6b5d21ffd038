"""verl's forward_kl_topk distillation on real megatron-core (CPU, gloo, 2 ranks at TP=2, the
vocabulary split; distillation_world.py) against HF transformers' own models: the Megatron
teacher's top-k tokens and log-probs (`compute_teacher_top_k`) are HF's, so are the student's
log-probs at them (`compute_log_prob_at`), and the actor's logged
`actor/distillation_loss` is the token mean of clamp(sum_k q_k (log q_k - log p_k)) computed here
from HF's student and teacher logits at temperature 1, with both clamps binding; the update
trains on it alone (pure distillation, use_task_rewards=false)."""
import pytest
import torch
from distillation_world import MAX_CLAMP, MIN_CLAMP, TOPK, distillation_world
from engine_world import training_batch

from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world, a teacher and an actor


@pytest.fixture(scope="module")
def run(tiny_models):
    return run_gloo_workers(distillation_world, 2, args=(tiny_models,), timeout_s=300)


def hf_next_token_log_probs(model_dir, batch) -> list[torch.Tensor]:
    """Per row, [r, V] log_softmax(logits) at the positions predicting its r response tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        with torch.no_grad():
            logits = model(torch.cat([prompt, response])[None]).logits[0].float()
        rows.append(logits.log_softmax(-1)[len(prompt) - 1: len(prompt) - 1 + len(response)])
    return rows


def test_the_teacher_top_k_and_the_distillation_loss_are_hfs(run, tiny_models):
    batch = training_batch(1)
    teacher = hf_next_token_log_probs(tiny_models["qwen2_reseeded"], batch)
    student = hf_next_token_log_probs(tiny_models["qwen2"], batch)
    scored = next(r["scored"] for r in run if r["scored"] is not None)
    student_at_top_k = next(r["student_at_top_k"] for r in run if r["student_at_top_k"] is not None)["log_probs"]
    losses, unclamped = [], []
    for i, (t, s) in enumerate(zip(teacher, student)):
        n = len(t)
        top_values, top_ids = t.topk(TOPK, -1)
        assert torch.equal(scored["teacher_topk_ids"][i, :n], top_ids)
        torch.testing.assert_close(scored["teacher_topk_log_probs"][i, :n], top_values, rtol=1e-5, atol=1e-5)
        response = batch["response_ids"][i][:n]
        torch.testing.assert_close(scored["teacher_log_probs"][i, :n], t.gather(1, response[:, None]).squeeze(1),
                                   rtol=1e-5, atol=1e-5)
        assert not scored["teacher_topk_ids"][i, n:].any()
        torch.testing.assert_close(student_at_top_k[i, :n], s.gather(1, top_ids), rtol=1e-5, atol=1e-5)
        q, p = top_values.clamp_min(MIN_CLAMP), s.gather(1, top_ids).clamp_min(MIN_CLAMP)
        kl = (q.exp() * (q - p)).sum(-1).clamp_min(0.0)
        unclamped.append((top_values.exp() * (top_values - s.gather(1, top_ids))).sum(-1))
        losses.append(kl.clamp(-MAX_CLAMP, MAX_CLAMP))
    expected = torch.cat(losses).mean().item()  # token-mean over the one mini-batch
    unclamped = torch.cat(unclamped)
    assert (unclamped > MAX_CLAMP).any() and (unclamped < MAX_CLAMP).any()  # the loss clamp binds on some tokens
    assert (torch.cat(student).min() < MIN_CLAMP) and (torch.cat(teacher).max() > MIN_CLAMP)
    for rank in run:
        metrics = rank["metrics"]
        assert metrics["actor/distillation_loss"] == pytest.approx(expected, rel=1e-4)
        assert metrics["actor/grad_norm"] > 0  # the update trains on the distillation term
