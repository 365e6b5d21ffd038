"""Corrections of the rollout/trainer mismatch: importance weights, rejection masks, diagnostics.

The rollout engine samples from pi_rollout, the trainer scores the same tokens as pi_old (other
kernels, precision, MoE routing, or older weights in the async modes). With
l_t = log pi_old(y_t) - log pi_rollout(y_t) (nats, `old_log_prob - rollout_log_prob`), per token:

  truncated IS, token     w_t = min(exp(l_t), C)                      (Yao et al. 2025, "TIS")
  truncated IS, sequence  w_t = min(exp(sum_s l_s), C), every t of the row        ("Seq-TIS")
  IcePop                  w_t = rho if lower <= rho <= upper else 0, rho = exp(l_t) (token) or
                          exp(sum_s l_s) (sequence)                   (Ling team 2025, IcePop)
  rejection (masked IS)   keep a token (token_*) or a whole row (seq_*) where its statistic is
                          inside the threshold; several options must all keep it. Statistics of
                          each token: k1 = -l_t, k2 = l_t^2 / 2, k3 = exp(l_t) - 1 - l_t; seq_sum /
                          seq_mean / seq_max: their sum / mean / max over the row

The weights multiply each token's policy loss, without gradient; the mask removes tokens from the
loss (and, before the advantages, from GAE, REINFORCE++ and the critic: megarl.trainer.experience).
Formulas, options and metric names are verl 0.9.1's `algorithm.rollout_correction`
(`verl/trainer/ppo/rollout_corr_helper.py`), checked against that file by
tests/algos/test_rollout_correction_verl.py: each l_t is clamped to +-20 before a token statistic
is formed (k1..k3, then summed, averaged or maxed), a sequence IS weight sums first and clamps the
sum, as verl's.

Where megarl differs from verl's code, on purpose (the test checks both as "verl's code under
megarl's rule"):
- A k1 band bounds rho itself, as verl's documentation states ("0.7_1.3" keeps 0.7 <= rho <= 1.3);
  verl's code compares k1 = -log rho with [log lower, log upper], which keeps 1/upper <= rho <=
  1/lower: its band reflected (the same for a band symmetric in log, lower = 1/upper, which a
  lone number U gives). So megarl's band [lower, upper] is verl's code with "1/upper_1/lower".
- Statistics over sequences (fractions of rows, per-row means, perplexities) count the rows with
  a valid token (a failed agent episode has none); verl's divide by every row of the batch. So
  megarl's metrics are verl's code on the rows with a valid token.
- An effective sample size with every weight 0 (IcePop dropping all) is 0; verl divides by zero.

Inputs are `[batch, response_len]` tensors with `mask` (1 = valid response token). Metrics are
computed in float64; over nothing, a max is -inf, a min +inf, a mean 0 (a micro-batch without a
valid token then leaves the reductions of megarl.algos.metrics unchanged).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from megarl.algos.masked import masked_mean, masked_sum
from megarl.config.rules.rollout_correction import RS_OPTIONS

SAFETY_BOUND = 20.0  # |log ratio| is clamped to this before exp, as verl's (exp(20) ~ 4.9e8)
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")  # the policy loss of verl's bypass mode
ESS_EPS = 1e-8  # verl's: the weights are divided by (their mean + 1e-8) in the effective sample size
PREFIX = "rollout_corr/"  # verl's metrics
OWN_PREFIX = "rollout_corr_megarl/"  # megarl's own metrics, none of verl's names


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, R] log rho at `level`: l_t itself ("token"), or each row's sum_t l_t at every position
    ("sequence"); clamped to +-20, 0 at padding."""
    if level == "token":
        value = log_ratio
    elif level == "sequence":
        value = masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    else:
        raise ValueError(f"unknown importance-sampling level {level!r}; choose from {list(IS_LEVELS)}")
    return torch.where(mask.bool(), value.clamp(-SAFETY_BOUND, SAFETY_BOUND), 0.0)


def truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, cap: float) -> torch.Tensor:
    """Truncated importance sampling, token (TIS) or sequence (Seq-TIS) level: [B, R]
    w = min(rho, cap), rho = exp(l_t) or exp(sum_t l_t) of the row; 0 at padding, no gradient."""
    rho = torch.exp(level_log_ratio(log_ratio.detach(), mask, level))
    return torch.where(mask.bool(), rho.clamp(max=cap), 0.0)


def icepop_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, lower: float,
                   upper: float) -> torch.Tensor:
    """IcePop: [B, R] w = rho where lower <= rho <= upper, else 0 (the token, or the whole row at
    sequence level, leaves the gradient; it still counts in the loss's normalisation); 0 at padding,
    no gradient."""
    rho = torch.exp(level_log_ratio(log_ratio.detach(), mask, level))
    inside = (rho >= lower) & (rho <= upper) & mask.bool()
    return torch.where(inside, rho, 0.0)


# ------------------------------------------------------------------ reductions over possibly nothing
def _max(x: torch.Tensor) -> float:
    return x.max().item() if x.numel() else -math.inf


def _min(x: torch.Tensor) -> float:
    return x.min().item() if x.numel() else math.inf


def _mean(x: torch.Tensor) -> float:
    return x.double().mean().item() if x.numel() else 0.0


def _std(x: torch.Tensor) -> float:
    """Bessel-corrected, as torch's (and verl's) `std`; 0 for fewer than two values."""
    return x.std().item() if x.numel() > 1 else 0.0


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return masked_mean(x.double(), mask).item()


def _clamped_std(stat: torch.Tensor, mask: torch.Tensor, lower: float, upper: float) -> float:
    """verl's `*_std`: the population std over valid tokens of `stat` clamped to [lower, upper]
    (0 for fewer than two valid tokens)."""
    if mask.bool().sum() <= 1:
        return 0.0
    clamped = stat.clamp(min=lower, max=upper)
    var = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
    return var.clamp(min=0.0).sqrt().item()


def _with_valid_token(*tensors: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """`tensors` ([B, ...] each) and `mask`, restricted to the rows with a valid token."""
    rows = mask.bool().any(-1)
    return [t[rows] for t in tensors] + [mask[rows]]


# ------------------------------------------------------------------ importance weights
def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, lower: Optional[float], upper: float,
               batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's `compute_rollout_correction_weights`: ([B, R] float64 weights, 0 at padding, no
    gradient; metrics without prefix). TIS at cap `upper` when `lower` is None, else IcePop on
    [lower, upper]. `batch_normalize` divides the weights by their mean over valid tokens
    ("token") or over rows of the per-row means ("sequence"), when that mean is above 1e-8, as
    verl's (`rollout_is_batch_norm_factor`; the metrics are of the weights before it)."""
    log_ratio = log_ratio.detach().double()
    raw = torch.where(mask.bool(), torch.exp(level_log_ratio(log_ratio, mask, level)), 0.0)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = _is_metrics(weights, raw, log_ratio, mask, level, lower, upper)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            rows = mask.bool().any(-1)
            mean = masked_mean(weights, mask, dim=-1)[rows].sum() / rows.sum().clamp(min=1)
        factor = mean.item() if mean > 1e-8 else 1.0
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, metrics


def _is_metrics(weights: torch.Tensor, raw: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                level: str, lower: Optional[float], upper: float) -> dict[str, float]:
    """verl's `compute_is_metrics` (+ `rollout_is_oob_ratio` with IcePop) on the rows with a valid
    token, and megarl's share of rows with a capped (TIS) or zeroed (IcePop) token."""
    weights, raw, log_ratio, mask = _with_valid_token(weights, raw, log_ratio, mask=mask)
    valid = mask.bool()
    band_lower = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": _token_mean(weights, mask)}
    if level == "sequence":  # the rows' sum of l_t, not clamped
        seq_log = masked_sum(log_ratio, mask, dim=-1)
        m["rollout_is_max"] = math.exp(min(_max(seq_log), SAFETY_BOUND))
        m["rollout_is_min"] = torch.exp(seq_log.min()).item() if seq_log.numel() else math.inf
        m["rollout_is_ratio_fraction_high"] = _mean(seq_log > math.log(upper))
        m["rollout_is_ratio_fraction_low"] = _mean(seq_log < math.log(band_lower))
    else:
        m["rollout_is_ratio_fraction_high"] = _token_mean(raw > upper, mask)
        m["rollout_is_ratio_fraction_low"] = _token_mean(raw < band_lower, mask)
        m["rollout_is_max"] = _max(weights[valid])
        m["rollout_is_min"] = _min(weights[valid])
    m["rollout_is_std"] = _clamped_std(weights, mask, 0.0, upper)
    for_ess = weights.clamp(min=0.0, max=upper)
    normalised = for_ess / (masked_mean(for_ess, mask) + ESS_EPS)
    second_moment = _token_mean(normalised.square(), mask)
    m["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment > 0 else 0.0
    seq_weights = masked_mean(weights, mask, dim=-1)
    raw_seq_weights = masked_mean(raw, mask, dim=-1)
    m.update({
        "rollout_is_seq_mean": _mean(seq_weights),
        "rollout_is_seq_std": _std(seq_weights),
        "rollout_is_seq_max": _max(seq_weights),
        "rollout_is_seq_min": _min(seq_weights),
        "rollout_is_seq_max_deviation": _max((seq_weights - 1.0).abs()),
        "rollout_is_seq_fraction_high": _mean(raw_seq_weights > upper),
        "rollout_is_seq_fraction_low": _mean(raw_seq_weights < band_lower),
    })
    if lower is None:
        m[OWN_PREFIX + "is_seq_capped_fraction"] = _mean((valid & (raw > upper)).any(-1))
    else:
        outside = valid & ((raw < lower) | (raw > upper))
        m["rollout_is_oob_ratio"] = _token_mean(outside, mask)
        m[OWN_PREFIX + "is_seq_oob_fraction"] = _mean(outside.any(-1))
    return m


# ------------------------------------------------------------------ rejection
def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor,
                   options: Sequence[tuple[str, Optional[float], float]]) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's `compute_rollout_rejection_mask`: ([B, R] bool, True where a valid token is kept by
    every option; metrics without prefix). `options`: (option of RS_OPTIONS, lower, upper) each,
    in order: a k1 option keeps lower <= rho <= upper, rho = exp(-k1) = exp(l_t), exp(sum_t l_t) or
    exp(mean_t l_t) of the clamped l; a k2/k3 option (lower None) keeps its statistic <= upper."""
    log_ratio = log_ratio.detach().double()
    valid = mask.bool()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token_stats = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    keep = valid.clone()
    metrics: dict[str, float] = {}
    for option, lower, upper in options:
        if option not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {option!r}; choose from {list(RS_OPTIONS)}")
        kind, estimator = option.rsplit("_", 1)
        stat = token_stats[estimator]
        if kind == "token":
            seq_stat = None
        elif kind == "seq_sum":
            seq_stat = masked_sum(stat, mask, dim=-1)
        elif kind == "seq_mean":
            seq_stat = masked_mean(stat, mask, dim=-1)
        else:  # seq_max; 0 for a row without a valid token, as verl's
            seq_stat = torch.where(valid, stat, -math.inf).amax(-1)
            seq_stat = torch.where(valid.any(-1), seq_stat, 0.0)
        if seq_stat is not None:
            stat = seq_stat[:, None].expand_as(stat)
        if estimator == "k1":  # megarl's band on rho: k1 = -log rho in [-log upper, -log lower]
            low, high = -math.log(upper), -math.log(lower)
            option_keep = (stat >= low) & (stat <= high)
        else:
            low, high = None, upper
            option_keep = stat <= high
        metrics.update(_rs_metrics(option, stat, seq_stat, mask, low, high))
        metrics[f"rollout_rs_{option}_masked_fraction"] = _token_mean(~option_keep, mask)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = _seq_share(valid & ~option_keep, mask)
        keep &= option_keep
    metrics["rollout_rs_masked_fraction"] = _token_mean(~keep, mask)
    metrics["rollout_rs_seq_masked_fraction"] = _seq_share(valid & ~keep, mask)
    return keep, metrics


def _seq_share(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of the rows with a valid token that have a valid token where `flags` holds."""
    rows = mask.bool().any(-1)
    return _mean((flags.bool() & mask.bool()).any(-1)[rows])


def _rs_metrics(option: str, stat: torch.Tensor, seq_stat: Optional[torch.Tensor], mask: torch.Tensor,
                lower: Optional[float], upper: float) -> dict[str, float]:
    """verl's `compute_rs_metrics` for one option: `stat` [B, R] per token (a row's statistic at
    each of its positions for a sequence option, `seq_stat` [B]); the bounds on the statistic
    (`lower` None: an upper bound only). On the rows with a valid token."""
    if seq_stat is None:
        stat, mask = _with_valid_token(stat, mask=mask)
        seq_values = masked_mean(stat, mask, dim=-1)
    else:
        stat, seq_values, mask = _with_valid_token(stat, seq_stat, mask=mask)
    valid = mask.bool()
    p = f"rollout_rs_{option}"
    m = {f"{p}_mean": _token_mean(stat, mask)}
    if seq_stat is not None:
        m[f"{p}_max"], m[f"{p}_min"] = _max(seq_values), _min(seq_values)
        m[f"{p}_fraction_high"] = _mean(seq_values > upper)
        m[f"{p}_fraction_low"] = _mean(seq_values < lower) if lower is not None else 0.0
    else:
        m[f"{p}_max"], m[f"{p}_min"] = _max(stat[valid]), _min(stat[valid])
        m[f"{p}_fraction_high"] = _token_mean(stat > upper, mask)
        m[f"{p}_fraction_low"] = _token_mean(stat < lower, mask) if lower is not None else 0.0
    m[f"{p}_std"] = _clamped_std(stat, mask, 0.0 if lower is None else lower, upper)
    m.update({
        f"{p}_seq_mean": _mean(seq_values),
        f"{p}_seq_std": _std(seq_values),
        f"{p}_seq_max": _max(seq_values),
        f"{p}_seq_min": _min(seq_values),
        f"{p}_seq_max_deviation": _max(seq_values.abs()),
        f"{p}_seq_fraction_high": _mean(seq_values > upper),
    })
    if lower is not None:
        m[f"{p}_seq_fraction_low"] = _mean(seq_values < lower)
    return m


# ------------------------------------------------------------------ the batch
def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: Optional[str] = None,
    is_lower: Optional[float] = None,
    is_upper: float = 2.0,
    is_batch_normalize: bool = False,
    rejection: Sequence[tuple[str, Optional[float], float]] = (),
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """The batch's weights and mask, verl's `compute_rollout_correction_and_rejection_mask` without
    its diagnostics (`offpolicy_metrics`): (IS weights [B, R] float32 or None without `rollout_is`,
    keep [B, R] bool, metrics named `rollout_corr/...` as verl's, and megarl's own
    `rollout_corr_megarl/...`).

    `rollout_is` "token"|"sequence" with `is_lower`, `is_upper`, `is_batch_normalize` (`is_weights`);
    `rejection` the options of `rejection_mask` (none: every valid token is kept)."""
    log_ratio = old_log_prob.double() - rollout_log_prob.double()
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = is_weights(log_ratio, mask, rollout_is, is_lower, is_upper, is_batch_normalize)
        weights = weights.float()
        metrics.update(is_metrics)
    keep = mask.bool()
    if rejection:
        keep, rs_metrics = rejection_mask(log_ratio, mask, rejection)
        metrics.update(rs_metrics)
    return weights, keep, _prefixed(metrics)


def offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's `compute_offpolicy_metrics`, named `rollout_corr/...`, on the rows with a valid token:
    kl (mean of rollout - old over tokens), k3_kl (mean of exp(l) - l - 1), training_ppl /
    rollout_ppl (the rows' exp(-mean log-prob), averaged) and their logs training_log_ppl /
    rollout_log_ppl, log_ppl_diff (per row: rollout's mean log-prob minus the trainer's; its mean,
    log_ppl_abs_diff the mean of its size, log_ppl_diff_max/min), ppl_ratio (the rows'
    exp(log_ppl_diff), averaged), chi2_token (mean of rho^2, l clamped to +-20, minus 1), chi2_seq
    (the rows' exp(2 sum_t l_t), the sum clamped to +-20, averaged, minus 1)."""
    old, rollout, mask = _with_valid_token(old_log_prob.detach().double(), rollout_log_prob.detach().double(),
                                           mask=mask)
    log_ratio = old - rollout
    row_old, row_rollout = masked_mean(old, mask, dim=-1), masked_mean(rollout, mask, dim=-1)
    diff = row_rollout - row_old
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return _prefixed({
        "training_ppl": _mean(torch.exp(-row_old)),
        "training_log_ppl": _mean(-row_old),
        "kl": _token_mean(rollout - old, mask),
        "k3_kl": _token_mean(torch.exp(log_ratio) - log_ratio - 1.0, mask),
        "rollout_ppl": _mean(torch.exp(-row_rollout)),
        "rollout_log_ppl": _mean(-row_rollout),
        "log_ppl_diff": _mean(diff),
        "log_ppl_abs_diff": _mean(diff.abs()),
        "log_ppl_diff_max": _max(diff),
        "log_ppl_diff_min": _min(diff),
        "ppl_ratio": _mean(torch.exp(diff)),
        "chi2_token": _token_mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), mask) - 1.0,
        "chi2_seq": _mean(torch.exp(2.0 * seq_log_ratio)) - 1.0,
    })


def _prefixed(metrics: dict[str, float]) -> dict[str, float]:
    """verl's names under `rollout_corr/`; megarl's own keep theirs (`rollout_corr_megarl/...`)."""
    return {name if name.startswith(OWN_PREFIX) else PREFIX + name: value for name, value in metrics.items()}
