"""Policy, value and actor losses with verl's loss aggregation modes.

Inputs are per-token `[batch, response_len]` tensors with `response_mask` (1 = real response
token). Log-probabilities are of the sampled tokens, in nats. Every loss returns
`(loss, metrics)`: `loss` a 0-dim tensor carrying gradients, `metrics` a `Metrics` of detached
0-dim tensors (call `.item()` when logging), each declared with how it combines over
micro-batches (`megarl.algos.metrics`): the losses add up (SUM: aggregated with the mini-batch's
global counts), means over valid tokens are token-weighted (TOKEN_MEAN), ratio_max/min are
extremes, kl_coef is a constant.
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl.algos.kl import kl_penalty
from megarl.algos.masked import masked_count, masked_mean, masked_sum
from megarl.algos.metrics import Metrics, Reduction
from megarl.algos.rollout_correction import (
    LOSS_TYPES,
    level_log_ratio,
    offpolicy_metrics,
    rollout_correction,
    truncated_is_weights,
)
from megarl.config.rules.policy_loss import mode_option_problems

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSS_MODES = ("vanilla", "gspo", "gpg", "dppo_tv", "dppo_kl", "sapo", "cispo", "clip_cov", "kl_cov", "geo_mean",
                     "dro")
# the modes whose loss and ppo_kl take the tokens' log-ratios unclamped (verl 0.9.1's); the others clamp them to +-20
UNCLAMPED_MODES = ("gspo", "clip_cov", "kl_cov", "geo_mean", "dro")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
) -> torch.Tensor:
    """Reduce a per-token loss `[batch, response_len]` to a scalar. With m the mask, L the loss:

    token-mean               sum_{i,t} m L / N_tok
    token-sum                sum_{i,t} m L                          (verl 0.9.1's: no normaliser)
    seq-mean-token-sum       sum_i (sum_t m L) / N_seq
    seq-mean-token-mean      sum_i (sum_t m L / sum_t m) / N_seq
    seq-mean-token-sum-norm  sum_i (sum_t m L) / (N_seq * T)        (Dr.GRPO: a constant length T)

    N_tok = `num_tokens`, default the valid tokens here; N_seq = `num_seqs`, default the rows here
    with at least one valid token (a row without one contributes 0); T = `norm_length`, default
    `response_len` (pass `data.max_response_length` when micro-batches are padded to different
    lengths). When a mini-batch is cut into micro-batches whose losses are summed, pass the
    mini-batch's N_tok and N_seq so the sum equals the mini-batch loss. Denominators below 1 are
    taken as 1, so an empty batch gives 0, never NaN.
    """
    if loss_agg_mode == "token-mean":
        denominator = masked_count(loss_mask, dtype=loss_mat.dtype) if num_tokens is None else num_tokens
        return masked_sum(loss_mat, loss_mask) / _at_least_one(denominator, loss_mat)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose from {list(LOSS_AGG_MODES)}")
    token_sum = masked_sum(loss_mat, loss_mask, dim=-1)
    tokens = masked_count(loss_mask, dim=-1, dtype=loss_mat.dtype)
    seqs = (tokens > 0).sum().to(loss_mat.dtype) if num_seqs is None else num_seqs
    seqs = _at_least_one(seqs, loss_mat)
    if loss_agg_mode == "seq-mean-token-sum":
        return token_sum.sum() / seqs
    if loss_agg_mode == "seq-mean-token-mean":
        return (token_sum / tokens.clamp(min=1)).sum() / seqs
    length = loss_mat.shape[-1] if norm_length is None else norm_length
    return token_sum.sum() / (seqs * length)


def _at_least_one(value, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1)


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.to(torch.float32), mask)


def _ratio_metrics(ratio: torch.Tensor, kl_log_ratio: torch.Tensor, clamped_log_ratio: torch.Tensor,
                   mask: torch.Tensor) -> Metrics:
    """KL of the update from the per-token log-ratios (`kl_log_ratio` as the loss uses it, the k3
    estimate from the one clamped to +-20 so that it stays finite); statistics of the ratio used in
    the loss."""
    valid = mask.bool()
    any_valid = valid.any()  # without a valid token, max and min report 1
    metrics = Metrics()
    metrics.add("ppo_kl", masked_mean(-kl_log_ratio, mask), Reduction.TOKEN_MEAN)  # k1 estimate of KL(old || new)
    metrics.add("approx_kl", masked_mean(torch.expm1(clamped_log_ratio) - clamped_log_ratio, mask),
                Reduction.TOKEN_MEAN)  # k3 estimate, >= 0
    metrics.add("ratio_mean", masked_mean(ratio, mask), Reduction.TOKEN_MEAN)
    metrics.add("ratio_max", torch.where(any_valid, torch.where(valid, ratio, -torch.inf).amax(), 1.0), Reduction.MAX)
    metrics.add("ratio_min", torch.where(any_valid, torch.where(valid, ratio, torch.inf).amin(), 1.0), Reduction.MIN)
    return metrics


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_mode: str = "vanilla",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    kl_cov_ratio: float = 0.0002,
    ppo_kl_coef: float = 0.1,
    dro_beta: Optional[float] = None,
    rollout_log_prob: Optional[torch.Tensor] = None,
    tis_imp_ratio_cap: float = -1.0,
    rollout_is_weights: Optional[torch.Tensor] = None,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
) -> tuple[torch.Tensor, Metrics]:
    """The policy loss of `loss_mode` per token, aggregated by `agg_loss`.

    r_t = exp(log_prob - old_log_prob), the log-ratio clamped to [-20, 20] in vanilla, sapo, cispo
    and dppo_*, unclamped in the other modes (as verl 0.9.1's `compute_policy_loss_<mode>`).

    vanilla: PPO's clipped surrogate. L_t = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high));
        for A < 0 the dual clip (Ye et al. 2019) further bounds L_t <= -A * clip_ratio_c. Separate
        low/high bounds give DAPO's clip-higher.
    gspo: one ratio per response, s_i = exp(mean_t(log_prob - old_log_prob)) (Zheng et al. 2025),
        used at every token as sg[s_i] * pi / sg[pi] so the gradient is s_i * mean_t grad log pi;
        L_t = max(-A s, -A clip(s, 1 - low, 1 + high)); no dual clip. Only the sequence's
        log-ratio is clamped (at most 10). The paper's objective is `loss_agg_mode="seq-mean-token-mean"`.
    gpg (Chu et al. 2025): L_t = -A log pi(y_t), the policy gradient itself: no ratio, no clip
        (`old_log_prob` feeds only the ratio metrics).
    dppo_tv, dppo_kl (DPPO, arXiv:2602.04879): L_t = -A sg[min(r, clip_ratio_c)] log pi(y_t) on the
        tokens inside a trust region, 0 on the others: with p = exp(log_prob), q = exp(old_log_prob)
        (probabilities of the sampled token), a token with A > 0 stays while p - q <= clip_ratio_high
        (tv), or while D <= clip_ratio_high or p <= q (kl); a token with A <= 0 while p - q >=
        -clip_ratio_low (tv), or while D <= clip_ratio_low or p >= q (kl); D = q log(q / p) + (1 - q)
        log((1 - q + 1e-8) / (1 - p + 1e-8)), the KL between the old and new Bernoulli "this token or
        another". clip_ratio_low/high are divergence thresholds here (verl's script: 0.15 tv, 0.05
        kl) and clip_ratio_c truncates the ratio (in place of the dual clip). The gradient is
        -A min(r, c) grad log pi on the kept tokens: PPO's where r = 1.
    sapo (SAPO, arXiv:2511.20347): a smooth gate in place of the clip, L_t = -A g(r),
        g(r) = sigmoid(tau (r - 1)) 4 / tau with tau = `tau_pos` where A > 0, `tau_neg` elsewhere
        (g(1) = 2 / tau, g'(1) = 1: PPO's gradient at r = 1, fading as r leaves 1). Always
        aggregated by seq-mean-token-mean whatever `loss_agg_mode` says, as verl's.
    cispo (CISPO, arXiv:2506.13585): L_t = -sg[clip(r, 1 - low, 1 + high)] A log pi(y_t): the
        clipped ratio only weighs the gradient, which every token keeps.
    clip_cov (Clip-Cov, Cui et al. 2025, arXiv:2505.22617): PPO's clipped surrogate (no dual clip)
        with the gradient cut (L_t = 0) on max(1, int(clip_cov_ratio x valid tokens)) tokens drawn
        at random (`torch.randperm` on torch's default CPU generator, as verl's) from those not
        already clipped whose covariance C_t = (A_t - mean A)(log pi_t - mean log pi) (means over this
        micro-batch's valid tokens) lies in (clip_cov_lb, clip_cov_ub).
    kl_cov (KL-Cov, same paper): L_t = -A r, plus ppo_kl_coef |log r| on the max(1, int(kl_cov_ratio x
        valid tokens)) tokens of largest covariance C_t; no clip.
    geo_mean (GMPO, arXiv:2507.20673): one loss per response, L_i = -mean_t(A) exp(mean_t(l_t)) with
        l_t the log-ratio clipped toward the advantage's side only (A > 0: min(l, clip_ratio_high);
        A < 0: max(l, -clip_ratio_low); A = 0: 0), averaged over the responses with a valid token
        (`num_seqs`), whatever `loss_agg_mode` says. verl takes the mean over every row of each
        micro-batch (`torch.mean`): the same loss where each mini-batch is one micro-batch without
        a row lacking a valid token (megarl's mean is the mini-batch's over any micro-batching).
        Token weights (TIS, `rollout_is_weights`) weigh L_i by their geometric mean over the response.
    dro (DRO with a quadratic penalty, verl's `compute_policy_loss_dro`): L_t = -(A log pi(y_t) -
        dro_beta / 2 (log r)^2); `dro_beta` > 0 is required.

    Truncated importance sampling (`tis_imp_ratio_cap` > 0; Yao et al. 2025): the rollout engine
    sampled from a slightly different distribution than the trainer's (other kernels, precision),
    so each token's L_t is weighted by w_t = min(exp(old_log_prob - rollout_log_prob), cap), no
    gradient through w. Metrics tis_weight_mean and tis_capfrac (share of tokens where the cap binds).
    `rollout_is_weights` [batch, response_len]: weights made before the update
    (`megarl.algos.rollout_correction`, verl's `rollout_is_weights`), multiplying L_t the same way.

    Metrics: pg_loss; except in gpg, kl_cov and dro (verl reports no clip there) pg_clipfrac
    (share of valid tokens clipped: in dppo left out by the trust region, in cispo with r outside
    [1 - low, 1 + high], in clip_cov cut by covariance (PPO's clip not counted, as verl), in
    geo_mean with l outside [-low, high] and A != 0, in sapo none), pg_clipfrac_high (of them those
    with A > 0), pg_clipfrac_low (those with A <= 0), pg_clipfrac_dual (the bound clip_ratio_c
    binding: the dual clip, in dppo the truncation of a kept token's ratio; 0 in the other modes);
    ppo_kl (mean of old_log_prob - log_prob, clamped as the mode clamps it), approx_kl (k3, >= 0,
    from the +-20-clamped log-ratio in every mode); ratio_mean/max/min of the ratio the loss uses
    (gspo, geo_mean: each response's, at each of its tokens); kl_cov adds ppo_kl_abs (mean |log r|).
    verl's names: its pg_clipfrac_lower is pg_clipfrac_dual, except in geo_mean where verl's
    pg_clipfrac / pg_clipfrac_lower are pg_clipfrac_high / pg_clipfrac_low; in kl_cov verl's
    ppo_kl is ppo_kl_abs.
    """
    if loss_mode not in POLICY_LOSS_MODES:
        raise ValueError(f"unknown policy loss_mode {loss_mode!r}; choose from {list(POLICY_LOSS_MODES)}")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_ratio_c}: the dual-clip bound must be > 1")
    options = {"tau_pos": tau_pos, "tau_neg": tau_neg, "clip_cov_ratio": clip_cov_ratio, "kl_cov_ratio": kl_cov_ratio,
               "ppo_kl_coef": ppo_kl_coef, "dro_beta": dro_beta}
    problems = mode_option_problems(loss_mode, **options)
    if problems:
        raise ValueError(f"loss_mode={loss_mode}: " + "; ".join(f"{name}={options[name]}: {why}" for name, why in problems))
    delta = log_prob - old_log_prob
    log_ratio = torch.clamp(delta, min=-20.0, max=20.0)
    ratio, kl_log_ratio = torch.exp(log_ratio), log_ratio
    if loss_mode in UNCLAMPED_MODES:
        kl_log_ratio = delta
    if loss_mode == "gspo":
        seq_log_ratio = masked_mean(delta, response_mask, dim=-1)
        ratio = torch.exp(torch.clamp(seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach(), max=10.0))
    elif loss_mode in ("clip_cov", "kl_cov"):
        ratio = torch.exp(delta)
    clip_active = dual_active = torch.zeros_like(response_mask, dtype=torch.bool)
    if loss_mode in ("vanilla", "gspo", "clip_cov"):
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
        ppo = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
        if loss_mode == "vanilla":
            dual_bound = -advantages * clip_ratio_c
            dual_active = (advantages < 0) & (ppo > dual_bound)
            loss_mat = torch.where(advantages < 0, torch.minimum(ppo, dual_bound), ppo)
        elif loss_mode == "gspo":
            loss_mat = ppo
        else:
            clip_active = _clip_cov_cut(advantages, log_prob.detach(), response_mask, clip_active,
                                        clip_cov_ratio, clip_cov_lb, clip_cov_ub)
            loss_mat = torch.where(clip_active, 0.0, ppo)
    elif loss_mode == "gpg":
        loss_mat = -advantages * log_prob
    elif loss_mode in ("dppo_tv", "dppo_kl"):
        kept = _dppo_trust_region(loss_mode, log_prob.detach(), old_log_prob, advantages,
                                  clip_ratio_low, clip_ratio_high)
        truncated = torch.clamp(ratio.detach(), max=clip_ratio_c)
        loss_mat = torch.where(kept, -advantages * truncated * log_prob, 0.0)
        clip_active, dual_active = ~kept, kept & (ratio.detach() > clip_ratio_c)
    elif loss_mode == "sapo":
        tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
        loss_mat = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
    elif loss_mode == "cispo":
        bounded = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
        loss_mat = -bounded * advantages * log_prob
        clip_active = ratio.detach() != bounded
    elif loss_mode == "kl_cov":
        penalised = _kl_cov_tokens(advantages, log_prob.detach(), response_mask, kl_cov_ratio)
        loss_mat = -advantages * ratio
        loss_mat = torch.where(penalised, loss_mat + ppo_kl_coef * delta.abs(), loss_mat)
    elif loss_mode == "dro":
        loss_mat = -(log_prob * advantages - 0.5 * dro_beta * delta.square())

    weights, tis_metrics = [], Metrics()
    if tis_imp_ratio_cap > 0:
        if rollout_log_prob is None:
            raise ValueError(f"tis_imp_ratio_cap={tis_imp_ratio_cap} needs rollout_log_prob (the rollout's log-probs)")
        rollout_log_ratio = (old_log_prob - rollout_log_prob).detach()
        raw = torch.exp(level_log_ratio(rollout_log_ratio, response_mask, "token"))
        weight = truncated_is_weights(rollout_log_ratio, response_mask, "token", tis_imp_ratio_cap)
        weights.append(weight)
        tis_metrics.add("tis_weight_mean", masked_mean(weight, response_mask), Reduction.TOKEN_MEAN)
        tis_metrics.add("tis_capfrac", _fraction(raw > tis_imp_ratio_cap, response_mask), Reduction.TOKEN_MEAN)
    if rollout_is_weights is not None:
        weights.append(rollout_is_weights.detach())
    if loss_mode == "geo_mean":
        loss, ratio, clip_active = _geo_mean_loss(delta, advantages, response_mask, clip_ratio_low, clip_ratio_high,
                                                  weights, num_seqs)
    else:
        for weight in weights:
            loss_mat = loss_mat * weight
        loss = agg_loss(loss_mat, response_mask, "seq-mean-token-mean" if loss_mode == "sapo" else loss_agg_mode,
                        num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)

    with torch.no_grad():
        metrics = Metrics()
        metrics.add("pg_loss", loss.detach(), Reduction.SUM)
        if loss_mode not in ("gpg", "kl_cov", "dro"):
            positive = advantages > 0
            metrics.add("pg_clipfrac", _fraction(clip_active, response_mask), Reduction.TOKEN_MEAN)
            metrics.add("pg_clipfrac_high", _fraction(clip_active & positive, response_mask), Reduction.TOKEN_MEAN)
            metrics.add("pg_clipfrac_low", _fraction(clip_active & ~positive, response_mask), Reduction.TOKEN_MEAN)
            metrics.add("pg_clipfrac_dual", _fraction(dual_active, response_mask), Reduction.TOKEN_MEAN)
        metrics.update(_ratio_metrics(ratio.detach(), kl_log_ratio.detach(), log_ratio.detach(), response_mask))
        if loss_mode == "kl_cov":
            metrics.add("ppo_kl_abs", masked_mean(delta.detach().abs(), response_mask), Reduction.TOKEN_MEAN)
        metrics.update(tis_metrics)
    return loss, metrics


def _covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[batch, response_len] C_t = (A_t - mean A)(log pi_t - mean log pi), the means over the valid
    tokens: each token's term of the covariance that drives the policy's entropy change
    (arXiv:2505.22617)."""
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


def _clip_cov_cut(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor, ppo_clipped: torch.Tensor,
                  share: float, lower: float, upper: float) -> torch.Tensor:
    """Clip-Cov's cut tokens (bool [batch, response_len], see `policy_loss`): of the valid tokens not
    `ppo_clipped` with covariance in (lower, upper), max(1, int(share x valid tokens)) drawn by
    `torch.randperm` over them in row-major order, from torch's default CPU generator as verl's:
    the Megatron engine seeds it alike on every rank (megarl.engines.megatron.parallel
    `init_role_parallel_state`), so the TP and CP ranks of a replica, computing the same loss,
    draw the same tokens."""
    valid = mask.bool()
    covariance = _covariance(advantages, log_prob, mask)
    eligible = (valid & ~ppo_clipped & (covariance > lower) & (covariance < upper)).flatten().nonzero().squeeze(1)
    cut = torch.zeros_like(valid)
    if len(eligible):
        drawn = torch.randperm(len(eligible)).to(eligible.device)[: max(int(share * int(valid.sum())), 1)]
        cut.view(-1)[eligible[drawn]] = True
    return cut


def _kl_cov_tokens(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor, share: float) -> torch.Tensor:
    """KL-Cov's penalised tokens (bool [batch, response_len]): the max(1, int(share x valid tokens))
    valid tokens of largest covariance; none without a valid token."""
    valid = mask.bool()
    chosen = torch.zeros_like(valid)
    count = int(valid.sum())
    if count:
        top = torch.topk(_covariance(advantages, log_prob, mask)[valid], max(1, int(count * share))).indices
        chosen.view(-1)[valid.flatten().nonzero().squeeze(1)[top]] = True
    return chosen


def _geo_mean_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, low: float, high: float,
                   weights: list[torch.Tensor], num_seqs: Optional[float]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """GMPO's loss (see `policy_loss`) from the unclamped `log_ratio` [batch, response_len]: (loss,
    each response's ratio at its tokens [batch, response_len] (detached), the clipped tokens: l
    outside [-low, high] with A != 0, as verl counts them)."""
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -low, high)
    seq_ratio = torch.exp(masked_mean(sign * torch.minimum(sign * log_ratio, sign * bounded), mask, dim=-1))
    seq_loss = -masked_mean(advantages, mask, dim=-1) * seq_ratio
    for weight in weights:
        seq_loss = seq_loss * torch.exp(masked_mean(torch.log(weight), mask, dim=-1))
    loss = agg_loss(seq_loss[:, None], mask.bool().any(-1, keepdim=True), "seq-mean-token-sum", num_seqs=num_seqs)
    clipped = (log_ratio != bounded) & (advantages != 0)
    return loss, seq_ratio.detach()[:, None].expand_as(log_ratio), clipped.detach()


def _dppo_trust_region(loss_mode: str, log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                       low: float, high: float) -> torch.Tensor:
    """DPPO's kept tokens (bool [batch, response_len], see `policy_loss`): those whose probability
    has not left the trust region in the direction their advantage pushes it."""
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if loss_mode == "dppo_tv":
        rising, falling = prob - old_prob <= high, prob - old_prob >= -low
    else:  # the KL between Bernoulli(old_prob) and Bernoulli(prob)
        divergence = (old_prob * (old_log_prob - log_prob)
                      + (1.0 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)))
        rising, falling = (divergence <= high) | (prob <= old_prob), (divergence <= low) | (prob >= old_prob)
    return torch.where(advantages > 0, rising, falling)


def reinforce_loss(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is_weights: Optional[torch.Tensor] = None,
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE with importance weights, verl's `compute_policy_loss_reinforce` (bypass mode's
    loss_type=reinforce): L_t = -A_t w_t log pi(y_t), w [batch, response_len] the weights of
    `megarl.algos.rollout_correction` (no gradient; 1 without them), aggregated by `agg_loss`; the
    gradient is -A w grad log pi, no clipping. Metrics: pg_loss; ppo_kl (mean of
    rollout_log_prob - log_prob over valid tokens)."""
    loss_mat = -advantages * log_prob
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    loss = agg_loss(loss_mat, response_mask, loss_agg_mode,
                    num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    metrics = Metrics()
    metrics.add("pg_loss", loss.detach(), Reduction.SUM)
    metrics.add("ppo_kl", masked_mean((rollout_log_prob - log_prob).detach(), response_mask), Reduction.TOKEN_MEAN)
    return loss, metrics


def bypass_policy_loss(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_type: str,
    correction: dict,
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
    **ppo,
) -> tuple[torch.Tensor, Metrics]:
    """verl's bypass mode (`algorithm.rollout_correction.bypass_mode`, verl's
    `compute_policy_loss_bypass_mode`): the old log-probs are the rollout's. The weights and the
    rejection mask are made here, per micro-batch, from the current policy's `log_prob` (detached)
    against `rollout_log_prob` (`megarl.algos.rollout_correction.rollout_correction` with the
    keywords `correction`); the loss then runs on the kept tokens only (the counts `num_tokens`,
    `num_seqs` stay the mini-batch's). `loss_type` "ppo_clip": the vanilla `policy_loss` against the rollout's
    log-probs (keywords `ppo`), without weights (its ratio is the correction); "reinforce":
    `reinforce_loss` with the weights. Metrics: the loss's, plus the corrections' and
    `offpolicy_metrics` named as in the controller (`rollout_corr/...`), combined over
    micro-batches by the token-weighted mean, those ending in _max / _min as extremes (verl
    averages its micro-batches' values)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown bypass loss_type {loss_type!r}; choose from {list(LOSS_TYPES)}")
    with torch.no_grad():
        weights, keep, corrections = rollout_correction(log_prob.detach(), rollout_log_prob, response_mask,
                                                        **correction)
        corrections.update(offpolicy_metrics(log_prob.detach(), rollout_log_prob, response_mask))
    agg = dict(loss_agg_mode=loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    if loss_type == "reinforce":
        weights = None if weights is None else weights.to(log_prob.dtype)
        loss, metrics = reinforce_loss(log_prob, rollout_log_prob, advantages, keep, rollout_is_weights=weights, **agg)
    else:
        loss, metrics = policy_loss(rollout_log_prob, log_prob, advantages, keep, **ppo, **agg)
    for name, value in corrections.items():
        reduction = (Reduction.MAX if name.endswith("_max") else Reduction.MIN if name.endswith("_min")
                     else Reduction.TOKEN_MEAN)
        metrics.add(name, torch.tensor(value, dtype=torch.float64), reduction)
    return loss, metrics


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss: 0.5 * agg(max((v - R)^2, (v_clip - R)^2)) with
    v_clip = old_v + clip(v - old_v, -cliprange_value, cliprange_value).

    Metrics: vf_loss, vf_clipfrac (share of valid tokens where the clipped term is larger),
    vpred_mean.
    """
    vpred_clipped = old_values + torch.clamp(vpreds - old_values, -cliprange_value, cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode,
                          num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    with torch.no_grad():
        metrics = Metrics()
        metrics.add("vf_loss", loss.detach(), Reduction.SUM)
        metrics.add("vf_clipfrac", _fraction(clipped > unclipped, response_mask), Reduction.TOKEN_MEAN)
        metrics.add("vpred_mean", masked_mean(vpreds.detach(), response_mask), Reduction.TOKEN_MEAN)
    return loss, metrics


def actor_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_mode: str = "vanilla",
    mode_options: Optional[dict] = None,
    rollout_log_prob: Optional[torch.Tensor] = None,
    tis_imp_ratio_cap: float = -1.0,
    rollout_is_weights: Optional[torch.Tensor] = None,
    entropy_coeff: float = 0.0,
    use_kl_loss: bool = False,
    kl_loss_coef: float = 0.001,
    kl_loss_type: str = "low_var_kl",
    bypass: Optional[dict] = None,
    num_tokens: Optional[float] = None,
    num_seqs: Optional[float] = None,
    norm_length: Optional[int] = None,
    metric_counts: Optional[dict] = None,
) -> tuple[torch.Tensor, Metrics]:
    """The actor's loss: policy_loss - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl).

    `entropy` is the per-token entropy `[batch, response_len]` (see `megarl.algos.entropy`),
    needed when entropy_coeff != 0 and reported whenever given. With `use_kl_loss` the KL to the
    reference (`ref_log_prob`, estimator `kl_loss_type`) is added, aggregated like the policy loss.
    `mode_options`: the keywords of `policy_loss` that only some loss modes read (tau_pos, tau_neg,
    clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, dro_beta); unset ones keep
    its defaults (verl's).
    With `bypass` ({"loss_type", "correction"}: megarl.algos.from_config.bypass_kwargs) the policy
    term is `bypass_policy_loss` with `old_log_prob` the rollout's, in place of `loss_mode` (as
    verl's bypass mode replaces it); entropy and KL keep `response_mask`, as verl's.
    Metrics: those of `policy_loss` (or `bypass_policy_loss`), plus entropy, kl_loss, kl_coef where
    used, and actor_loss. `metric_counts` ({"num_tokens", "num_seqs"}; None: `num_tokens`,
    `num_seqs`): the counts the entropy metric is aggregated with where it is no loss term
    (entropy_coeff 0): those of the rows the update runs, where it leaves rows out.
    """
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
    clips = dict(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)
    if bypass is not None:
        loss, metrics = bypass_policy_loss(old_log_prob, log_prob, advantages, response_mask, **bypass, **clips,
                                           loss_agg_mode=loss_agg_mode, **agg)
    else:
        loss, metrics = policy_loss(
            old_log_prob, log_prob, advantages, response_mask, **clips,
            loss_agg_mode=loss_agg_mode, loss_mode=loss_mode, **(mode_options or {}),
            rollout_log_prob=rollout_log_prob, tis_imp_ratio_cap=tis_imp_ratio_cap,
            rollout_is_weights=rollout_is_weights, **agg,
        )
    if entropy_coeff != 0 and entropy is None:
        raise ValueError(f"entropy_coeff={entropy_coeff} needs the per-token entropy")
    if entropy is not None:
        entropy_agg = agg_loss(entropy, response_mask, loss_agg_mode, **agg)
        loss = loss - entropy_coeff * entropy_agg
        if entropy_coeff == 0 and metric_counts is not None:
            entropy_agg = agg_loss(entropy, response_mask, loss_agg_mode, **metric_counts, norm_length=norm_length)
        metrics.add("entropy", entropy_agg.detach(), Reduction.SUM)
    if use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("use_kl_loss=True needs ref_log_prob (the reference model's log-probs)")
        kl = agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode, **agg)
        loss = loss + kl_loss_coef * kl
        metrics.add("kl_loss", kl.detach(), Reduction.SUM)
        metrics.add("kl_coef", loss.new_tensor(float(kl_loss_coef)), Reduction.CONSTANT)
    metrics.add("actor_loss", loss.detach(), Reduction.SUM)
    return loss, metrics
