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

verl's distillation losses (`distillation.loss_mode`, verl 0.9.1 verl/trainer/distillation/losses.py),
a per-token loss l_t (nats) on the response tokens:

  k1 (kl), abs, k2 (mse), k3 (low_var_kl)   the single-sample estimators of `megarl.algos.kl.kl_penalty`
                                            on (student, teacher) log-probs of the sampled token
  forward_kl_topk                           sum_{i in top-k of the teacher} q_i (log q_i - log p_i), q the
                                            teacher's and p the student's probabilities at the teacher's
                                            top-k token ids, both log-probs floored at `log_prob_min_clamp`
                                            first when it is set; then floored at 0 (a truncated KL can be
                                            negative)

then clamped to [-loss_max_clamp, loss_max_clamp] when that is set (`clamp_losses`). How l_t trains:
use_policy_gradient=true puts it in the advantage as d_t above (A - kl_coef * l_t: the reward -l_t);
false backpropagates it directly, `direct_distillation_loss`: agg(l_t) with the actor's loss_agg_mode,
added to the policy loss times kl_coef (use_task_rewards=true) or alone (false: verl drops the policy
loss and the coefficient). k1 cannot be direct: its gradient does not depend on the teacher
(verl's `DistillationLossConfig.__post_init__` refuses it).
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl.algos.kl import KL_ESTIMATORS, kl_penalty
from megarl.algos.losses import agg_loss

TOPK_LOSS_MODE = "forward_kl_topk"  # the loss_mode that needs the teacher's top-k (the others: KL_ESTIMATORS)
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


def estimator_losses(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, loss_mode: str) -> torch.Tensor:
    """[B, R] l_t of a single-sample estimator `loss_mode` (one of KL_ESTIMATORS): verl's
    `compute_distillation_loss_reverse_kl_estimator`, `kl_penalty(student, teacher, loss_mode)`."""
    if loss_mode not in KL_ESTIMATORS:
        raise ValueError(f"unknown distillation estimator {loss_mode!r}; choose from {list(KL_ESTIMATORS)}")
    return kl_penalty(student_log_probs, teacher_log_probs, loss_mode)


def forward_kl_topk(student_topk_log_probs: torch.Tensor, teacher_topk_log_probs: torch.Tensor,
                    log_prob_min_clamp: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(l [...], student_mass [...], teacher_mass [...]) float32 from log-probs [..., K] of the
    student and the teacher at the teacher's top-k ids: l = max(0, sum_k q_k (log q_k - log p_k))
    after flooring both log-probs at `log_prob_min_clamp` (None: no floor); the masses are
    sum_k exp of the floored log-probs. As verl's Megatron `_VocabParallelKLDivergence.forward`
    (verl/trainer/distillation/megatron/losses.py) then `compute_forward_kl_topk`'s clamp_min(0); the
    gradient of l with respect to the student's logits is its backward's m_A p_j - q_j 1[j in A]."""
    student, teacher = student_topk_log_probs.float(), teacher_topk_log_probs.float().detach()
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    losses = (teacher.exp() * (teacher - student)).sum(-1)
    return losses.clamp_min(0.0), student.detach().exp().sum(-1), teacher.exp().sum(-1)


def clamp_losses(losses: torch.Tensor, loss_max_clamp: Optional[float]) -> torch.Tensor:
    """l_t clamped to [-loss_max_clamp, loss_max_clamp] (None: unchanged), verl's `distillation_loss`
    (the lower bound is for k1, which can be negative)."""
    return losses if loss_max_clamp is None else losses.clamp(-loss_max_clamp, loss_max_clamp)


def direct_distillation_loss(losses: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, *,
                             num_tokens: Optional[float] = None, num_seqs: Optional[float] = None,
                             norm_length: Optional[int] = None) -> torch.Tensor:
    """The distillation term of use_policy_gradient=false: `agg_loss` of the (clamped) per-token
    losses [B, R] over `mask`, with the actor's aggregation and the mini-batch's counts."""
    return agg_loss(losses, mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)


def opd_advantages(advantages: torch.Tensor, student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                   mask: torch.Tensor, *, kl_coef: float, use_task_rewards: bool,
                   teacher_mask: Optional[torch.Tensor] = None, loss_mode: str = "k1",
                   loss_max_clamp: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A' [B, R], d [B, R]): the advantages with the OPD term (formulas above; d the estimator
    `loss_mode`'s l_t, clamped by `loss_max_clamp`), 0 outside `mask`, and d on the scored tokens
    (0 elsewhere)."""
    losses = estimator_losses(student_log_probs.detach().float(), teacher_log_probs.detach().float(), loss_mode)
    return advantages_with_loss(advantages, losses, mask, kl_coef=kl_coef, use_task_rewards=use_task_rewards,
                                teacher_mask=teacher_mask, loss_max_clamp=loss_max_clamp)


def advantages_with_loss(advantages: torch.Tensor, losses: torch.Tensor, mask: torch.Tensor, *, kl_coef: float,
                         use_task_rewards: bool, teacher_mask: Optional[torch.Tensor] = None,
                         loss_max_clamp: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`opd_advantages` from per-token losses l_t [B, R] of any `loss_mode` (forward_kl_topk's
    included): (A', d) with d = clamp_losses(l) on the scored tokens (no gradient)."""
    scored = mask.bool() if teacher_mask is None else mask.bool() & teacher_mask.bool()
    d = torch.where(scored, clamp_losses(losses.detach().float(), loss_max_clamp), 0.0)
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
