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
(docs/algo/opd.md, PG OPD with the k1 estimator). The student's log-probs are the trainer's old
log-probs of the batch (slime's `log_probs`), taken at the rollout temperature, as the teacher's.

`teacher_mask` marks the response tokens the teacher scored (None: all of `mask`); a token it did
not score carries no OPD signal (d_t = 0 there), and `coverage` says how many were scored.
"""
from __future__ import annotations

from typing import Optional

import torch


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
