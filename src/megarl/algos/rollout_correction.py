"""Corrections of the rollout/trainer mismatch: importance weights and rejection masks.

The rollout engine samples from pi_rollout, the trainer scores the same tokens as pi_old (other
kernels, precision, MoE routing, or older weights in the async modes). With
l_t = log pi_old(y_t) - log pi_rollout(y_t) (nats, `old_log_prob - rollout_log_prob`), per token:

  truncated IS, token     w_t = min(exp(l_t), C)                      (Yao et al. 2025, "TIS")
  truncated IS, sequence  w_t = min(exp(sum_s l_s), C), every t of the row        ("Seq-TIS")
  IcePop                  w_t = rho if lower <= rho <= upper else 0, rho = exp(l_t) (token) or
                          exp(sum_s l_s) (sequence)                   (Ling team 2025, IcePop)
  masked IS (rejection)   keep_t = lower <= rho <= upper, rho per option:
                          token_k1: exp(l_t); seq_sum_k1: exp(sum_s l_s); seq_mean_k1: exp(mean_s l_s)
                          (the geometric mean); a sequence option keeps or drops whole rows ("Seq-MIS")

The weights multiply each token's policy loss, without gradient; the mask removes tokens from the
actor's loss and its normalisation. Names and formulas follow verl 0.9.1's
`algorithm.rollout_correction` (`verl/trainer/ppo/rollout_corr_helper.py`, docs/algo/rollout_corr.md):
`rollout_is` token|sequence with `rollout_is_threshold` C (TIS) or "lower_upper" (IcePop),
`rollout_rs` with `rollout_rs_threshold` "lower_upper". Exponents are clamped to +-20 as verl's.
Where megarl differs: the rejection band is on rho itself, as verl's documentation states ("0.7_1.3"
keeps 0.7 <= rho <= 1.3); verl's code compares -log rho with [log lower, log upper], which keeps
1/upper <= rho <= 1/lower (the same for a band symmetric in log, lower = 1/upper). Only the ratio
(k1) options of verl's `rollout_rs` are here, one at a time; sequence fractions count the rows with
a valid token (verl's divide by every row).

Inputs are `[batch, response_len]` tensors with `mask` (1 = valid response token).
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl.algos.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # |log ratio| is clamped to this before exp, as verl's (exp(20) ~ 4.9e8)
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "seq_sum_k1", "seq_mean_k1")


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


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, option: str, lower: float,
                   upper: float) -> torch.Tensor:
    """Masked importance sampling: [B, R] bool, True where the token is kept: lower <= rho <= upper
    with rho = exp(l_t) ("token_k1"), exp(sum_t l_t) ("seq_sum_k1") or exp(mean_t l_t)
    ("seq_mean_k1") of its row. False at padding."""
    log_ratio = log_ratio.detach()
    if option == "token_k1":
        log_rho = log_ratio
    elif option == "seq_sum_k1":
        log_rho = masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    elif option == "seq_mean_k1":
        log_rho = masked_mean(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    else:
        raise ValueError(f"unknown rollout_rs option {option!r}; choose from {list(RS_OPTIONS)}")
    rho = torch.exp(log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return (rho >= lower) & (rho <= upper) & mask.bool()


def _token_share(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of valid tokens where `flags` holds."""
    return masked_mean(flags.double(), mask).item()


def _seq_share(flags: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of rows with a valid token that have a valid token where `flags` holds."""
    valid = mask.bool()
    rows = valid.any(-1)
    hit = (flags.bool() & valid).any(-1)
    return (hit.sum() / rows.sum().clamp(min=1)).item()


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: Optional[str] = None,
    is_lower: Optional[float] = None,
    is_upper: float = 2.0,
    rollout_rs: Optional[str] = None,
    rs_lower: float = 0.5,
    rs_upper: float = 2.0,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """The batch's corrections, verl's `compute_rollout_correction_and_rejection_mask`:
    (IS weights [B, R] float32 or None without `rollout_is`, keep [B, R] bool, metrics).

    `rollout_is` "token"|"sequence": truncated IS at cap `is_upper` when `is_lower` is None, else
    IcePop on [is_lower, is_upper]. `rollout_rs` (one of RS_OPTIONS): masked IS on
    [rs_lower, rs_upper]; without it every valid token is kept. Metrics (verl's names under
    `rollout_corr/`; "share" counts valid tokens, "seq" rows with a valid token):
      rollout_is_mean                   mean weight over valid tokens
      rollout_is_ratio_fraction_high    share of tokens (rows at sequence level) with rho > is_upper
      rollout_is_ratio_fraction_low     ... with rho < is_lower (TIS: < 1 / is_upper)
      rollout_is_capped_fraction        TIS: share of tokens whose weight the cap lowered
      rollout_is_seq_capped_fraction    TIS: share of rows with such a token
      rollout_is_oob_ratio              IcePop: share of tokens set to 0
      rollout_is_seq_oob_ratio          IcePop: share of rows with such a token
      rollout_rs_masked_fraction        share of tokens dropped by the mask
      rollout_rs_seq_masked_fraction    share of rows with a dropped token
    """
    valid = mask.bool()
    log_ratio = (old_log_prob.double() - rollout_log_prob.double()).detach()
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        rho = torch.exp(level_log_ratio(log_ratio, mask, rollout_is))
        per_row = rollout_is == "sequence"
        share = _seq_share if per_row else _token_share
        lower = 1.0 / is_upper if is_lower is None else is_lower
        metrics["rollout_is_ratio_fraction_high"] = share(rho > is_upper, mask)
        metrics["rollout_is_ratio_fraction_low"] = share(rho < lower, mask)
        if is_lower is None:
            weights = truncated_is_weights(log_ratio, mask, rollout_is, is_upper)
            metrics["rollout_is_capped_fraction"] = _token_share(rho > is_upper, mask)
            metrics["rollout_is_seq_capped_fraction"] = _seq_share(rho > is_upper, mask)
        else:
            weights = icepop_weights(log_ratio, mask, rollout_is, is_lower, is_upper)
            outside = (rho < is_lower) | (rho > is_upper)
            metrics["rollout_is_oob_ratio"] = _token_share(outside, mask)
            metrics["rollout_is_seq_oob_ratio"] = _seq_share(outside, mask)
        metrics["rollout_is_mean"] = masked_mean(weights, mask).item()
        weights = weights.float()
    keep = valid
    if rollout_rs is not None:
        keep = rejection_keep(log_ratio, mask, rollout_rs, rs_lower, rs_upper)
        metrics["rollout_rs_masked_fraction"] = _token_share(valid & ~keep, mask)
        metrics["rollout_rs_seq_masked_fraction"] = _seq_share(valid & ~keep, mask)
    return weights, keep, {f"rollout_corr/{name}": value for name, value in metrics.items()}
