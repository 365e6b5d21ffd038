"""On-policy distillation (OPD): the teacher's per-token signal on the student's own samples.

The student samples y ~ pi_student; a frozen teacher scores the same tokens. Per response token t
(nats; `[B, R]` tensors, `mask` 1 = a response token the loss counts):

  reverse KL, one-sample (k1) estimate   d_t = log pi_student(y_t | s_t) - log pi_teacher(y_t | s_t)
  OPD + RL (use_task_rewards=true)       A'_t = A_t - kl_coef * d_t      (A_t: any estimator's advantage)
  pure OPD (use_task_rewards=false)      A'_t = -kl_coef * d_t           (no reward needed; n = 1 works)

d_t is a constant of the update (no gradient): the policy gradient of E[-d] is the gradient of the
reverse KL(pi_student || pi_teacher) on the student's own states (Thinking Machines Lab, Lu et al.,
"On-Policy Distillation", 2025; Agarwal et al., arXiv:2306.13649, ICLR 2024). Names and the
subtraction follow slime's `--use-opd --opd-kl-coef` (`apply_opd_kl_to_advantages` in
slime/backends/megatron_utils/loss.py: advantages - opd_kl_coef * (student - teacher)); the switch
between pure OPD and OPD + RL is verl's `distillation.distillation_loss.use_task_rewards`
(docs/algo/opd.md, PG OPD with the k1 estimator).

Both sides of d_t are at one temperature, `OPD_TEMPERATURE` = 1 (softmax(logits): the models
themselves), whatever `actor_rollout_ref.rollout.temperature` the student samples at; the
policy-gradient terms keep the rollout temperature (the PPO ratio is the sampling policy's). Why 1:
an SGLang teacher gives nothing else. SGLang 0.5.23 takes a plain log_softmax of the logits for input
tokens whatever the request's temperature (`srt/layers/logprob_processor.py`,
`InputLogprobProcessor._forward_by_chunk`), and a score at T = 1 cannot be turned into one at T
without the whole vocabulary's logits. So the student's side and a Megatron teacher follow, and both
teacher types give the same signal; a student at T against a teacher at 1 would be biased (distilled
from itself, it would get d_t != 0). What the signal drives to is unchanged: d_t = 0 on every sampled
token exactly where the two models agree, and models that agree at T = 1 agree at every T. At T != 1
the tokens come from the tempered student, so the mean of d_t weighs the models' per-token gaps by
where that student goes, and the student takes one more forward pass per step
(`student_needs_own_pass`). Refusing T != 1 with an SGLang teacher was the other way out; it would
forbid the usual sampling temperatures and change nothing in what a zero signal means.

`teacher_mask` marks the response tokens the teacher scored (None: all of `mask`); a token it did
not score carries no OPD signal (d_t = 0 there), and `coverage` says how many were scored.
"""
from __future__ import annotations

from typing import Optional

import torch

OPD_TEMPERATURE = 1.0  # the temperature of both sides of the reverse KL (module docstring)


def student_needs_own_pass(rollout_temperature: float) -> bool:
    """Whether the student's log-probs for d_t need a forward pass of their own at
    `OPD_TEMPERATURE`: the trainer's old-log-prob pass runs at the rollout temperature and serves
    only when that is `OPD_TEMPERATURE`."""
    return rollout_temperature != OPD_TEMPERATURE


def reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32 d_t = student - teacher (nats) where `mask`, 0 elsewhere; no gradient."""
    d = student_log_probs.detach().float() - teacher_log_probs.detach().float()
    return torch.where(mask.bool(), d, 0.0)


def opd_advantages(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   mask: torch.Tensor, *, kl_coef: float, use_task_rewards: bool,
                   teacher_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A' [B, R], d [B, R]): the advantages with the OPD term (formulas above), 0 outside `mask`,
    and the reverse-KL estimate d on the scored tokens (0 elsewhere)."""
    scored = mask.bool() if teacher_mask is None else mask.bool() & teacher_mask.bool()
    d = reverse_kl(student_log_probs, teacher_log_probs, scored)
    base = advantages.float() if use_task_rewards else torch.zeros_like(d)
    return torch.where(mask.bool(), base - kl_coef * d, 0.0), d


def opd_metrics(d: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor,
                teacher_mask: Optional[torch.Tensor] = None) -> dict[str, float]:
    """`opd/reverse_kl_mean` (mean d over scored tokens, nats), `opd/teacher_log_prob_mean` (mean
    teacher log-prob over scored tokens), `opd/coverage` (scored share of the `mask` tokens; 0
    when there are none)."""
    valid = mask.bool()
    scored = valid if teacher_mask is None else valid & teacher_mask.bool()
    count = int(scored.sum())
    total = int(valid.sum())
    return {
        "opd/reverse_kl_mean": d[scored].double().mean().item() if count else 0.0,
        "opd/teacher_log_prob_mean": teacher_log_probs[scored].double().mean().item() if count else 0.0,
        "opd/coverage": count / total if total else 0.0,
    }
