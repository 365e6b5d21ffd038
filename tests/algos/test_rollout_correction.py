"""The rollout-mismatch corrections (verl 0.9.1's algorithm.rollout_correction) on a batch worked by hand.

Three responses; rho_t = pi_old / pi_rollout of each valid token (written below), advantages A.
The trainer's log-probs equal the old ones, so the PPO ratio is 1, nothing clips and each token's
policy loss is -A_t; token-mean divides by the 6 valid tokens (or by the kept ones under a mask).

    row 0  rho [4.0, 0.5, 1.0]  A [1, 2, 3]   product 2.0, geometric mean 2^(1/3) = 1.26
    row 1  rho [1.5, 3.0]       A [-1, -2]    product 4.5, geometric mean sqrt(4.5) = 2.12
    row 2  rho [0.8]            A [4]         product 0.8, geometric mean 0.8

Without a correction the loss is (-1 - 2 - 3 + 1 + 2 - 4) / 6 = -7/6: every expected value below
differs from it (the negative control of each test).
"""
import math

import pytest
import torch

from megarl.algos.losses import policy_loss
from megarl.algos.rollout_correction import (
    icepop_weights,
    is_weights,
    rejection_mask,
    rollout_correction,
    truncated_is_weights,
)

NAN = float("nan")
RHO = torch.tensor([[4.0, 0.5, 1.0], [1.5, 3.0, 100.0], [0.8, 100.0, 100.0]], dtype=torch.float64)  # 100: padding
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
ADV = torch.tensor([[1.0, 2.0, 3.0], [-1.0, -2.0, NAN], [4.0, NAN, NAN]], dtype=torch.float64)
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -7.0], [-2.5, -9.0, -9.0]], dtype=torch.float64)
ROLLOUT = OLD - RHO.log()
LOG_RATIO = OLD - ROLLOUT
PLAIN = -7 / 6


def hand(t: torch.Tensor) -> list:
    """A [B, R] tensor's values row after row, to compare with the hand-written rows."""
    return t.flatten().tolist()


def loss_with(weights=None, mask=MASK) -> float:
    log_prob = OLD.clone().requires_grad_(True)
    loss, _ = policy_loss(OLD, log_prob, torch.nan_to_num(ADV), mask, rollout_is_weights=weights)
    return loss.item()


def test_without_a_correction_the_loss_is_the_plain_one():
    assert loss_with() == pytest.approx(PLAIN)


def test_token_truncated_is_by_hand():
    w = truncated_is_weights(LOG_RATIO, MASK, "token", 2.5)
    assert hand(w) == pytest.approx([2.5, 0.5, 1.0,  1.5, 2.5, 0.0,  0.8, 0.0, 0.0])
    # (2.5 * -1 + 0.5 * -2 + 1 * -3 + 1.5 * 1 + 2.5 * 2 + 0.8 * -4) / 6
    assert loss_with(w) == pytest.approx(-3.2 / 6)
    assert loss_with(truncated_is_weights(LOG_RATIO, MASK, "token", 3.5)) == pytest.approx(
        (3.5 * -1 - 1 - 3 + 1.5 + 3 * 2 - 3.2) / 6)  # another cap, another loss


def test_sequence_truncated_is_by_hand():
    w = truncated_is_weights(LOG_RATIO, MASK, "sequence", 3.0)  # row weights min(2, 3), min(4.5, 3), 0.8
    assert hand(w) == pytest.approx([2.0, 2.0, 2.0,  3.0, 3.0, 0.0,  0.8, 0.0, 0.0])
    assert loss_with(w) == pytest.approx((2 * -6 + 3 * 3 + 0.8 * -4) / 6)  # -6.2 / 6
    # the token level with the same cap weighs other tokens: not the sequence's value
    assert loss_with(truncated_is_weights(LOG_RATIO, MASK, "token", 3.0)) != pytest.approx(-6.2 / 6)


def test_weights_carry_no_gradient():
    log_ratio = LOG_RATIO.clone().requires_grad_(True)
    assert not truncated_is_weights(log_ratio, MASK, "sequence", 3.0).requires_grad
    assert not icepop_weights(log_ratio, MASK, "token", 0.6, 2.5).requires_grad
    log_prob = OLD.clone().requires_grad_(True)
    w = truncated_is_weights(LOG_RATIO, MASK, "token", 2.5)
    loss, _ = policy_loss(OLD, log_prob, torch.nan_to_num(ADV), MASK, rollout_is_weights=w)
    loss.backward()  # d(-A w r)/d log_prob = -A w at r = 1, over 6 tokens
    assert hand(log_prob.grad) == pytest.approx([-2.5 / 6, -1 / 6, -3 / 6,  1.5 / 6, 5 / 6, 0,  -3.2 / 6, 0, 0])


def test_icepop_token_level_by_hand():
    w = icepop_weights(LOG_RATIO, MASK, "token", 0.6, 2.5)  # 4.0, 0.5 and 3.0 leave [0.6, 2.5]
    assert hand(w) == pytest.approx([0.0, 0.0, 1.0,  1.5, 0.0, 0.0,  0.8, 0.0, 0.0])
    assert loss_with(w) == pytest.approx((-3 + 1.5 - 3.2) / 6)  # the zeroed tokens still count in the 6
    assert loss_with(icepop_weights(LOG_RATIO, MASK, "token", 0.4, 2.5)) == pytest.approx((-1 - 3 + 1.5 - 3.2) / 6)


def test_icepop_sequence_level_by_hand():
    w = icepop_weights(LOG_RATIO, MASK, "sequence", 0.6, 2.5)  # row 1's product 4.5 leaves the band
    assert hand(w) == pytest.approx([2.0, 2.0, 2.0,  0.0, 0.0, 0.0,  0.8, 0.0, 0.0])
    assert loss_with(w) == pytest.approx((2 * -6 - 3.2) / 6)
    assert icepop_weights(LOG_RATIO, MASK, "sequence", 0.6, 5.0)[1].tolist() == pytest.approx([4.5, 4.5, 0.0])


@pytest.mark.parametrize("option, lower, upper, kept, loss", [
    # 4.0, 0.5 and 3.0 leave [0.6, 2.5]: three tokens kept, the loss over them
    ("token_k1", 0.6, 2.5, [[0, 0, 1], [1, 0, 0], [1, 0, 0]], (-3 + 1 - 4) / 3),
    # the products 2.0, 4.5, 0.8: row 1 leaves [0.6, 2.5]
    ("seq_sum_k1", 0.6, 2.5, [[1, 1, 1], [0, 0, 0], [1, 0, 0]], (-6 - 4) / 4),
    # the geometric means 1.26, 2.12, 0.8: rows 1 and 2 leave [0.9, 2.0]
    ("seq_mean_k1", 0.9, 2.0, [[1, 1, 1], [0, 0, 0], [0, 0, 0]], -6 / 3),
    # [0.6, 2.5] on the means keeps every row (on the products it drops row 1)
    ("seq_mean_k1", 0.6, 2.5, [[1, 1, 1], [1, 1, 0], [1, 0, 0]], PLAIN),
])
def test_masked_is_keeps_the_tokens_or_rows_inside_the_band(option, lower, upper, kept, loss):
    keep, _ = rejection_mask(LOG_RATIO, MASK, [(option, lower, upper)])
    assert keep.int().tolist() == kept
    assert loss_with(mask=keep) == pytest.approx(loss)


def test_the_band_is_on_rho_itself_not_on_its_reciprocal():
    """0.3 <= rho <= 1.2 keeps 0.5, 1.0 and 0.8; the reciprocal band [1/1.2, 1/0.3] would keep 1.0, 1.5, 3.0."""
    keep, _ = rejection_mask(LOG_RATIO, MASK, [("token_k1", 0.3, 1.2)])
    assert keep.int().tolist() == [[0, 1, 1], [0, 0, 0], [1, 0, 0]]


def test_each_token_log_ratio_is_clamped_before_a_row_sums_or_averages_them():
    """The issue's smallest case: l = [40, -25, 0] clamps to [20, -20, 0], whose sum and mean are 0
    (rho 1, kept by [0.5, 2.0], as verl keeps it); summing first gives 15 (dropped)."""
    old = torch.tensor([[-0.5, -30.0, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-40.5, -5.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    for option in ("seq_sum_k1", "seq_mean_k1"):
        keep, m = rejection_mask(old - rollout, mask, [(option, 0.5, 2.0)])
        assert keep.tolist() == [[True, True, True]], option
        assert m[f"rollout_rs_{option}_mean"] == 0.0


# the divergences of each valid token, from the hand-written rho: k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho
K2 = [[0.9609, 0.2402, 0.0], [0.0822, 0.6035], [0.0249]]  # row 0: ln 4 = 1.386, ln 0.5 = -0.693
K3 = [[1.6137, 0.1931, 0.0], [0.0945, 0.9014], [0.0231]]


@pytest.mark.parametrize("option, upper, kept", [
    ("token_k2", 0.5, [[0, 1, 1], [1, 0, 0], [1, 0, 0]]),  # 0.96 and 0.60 exceed 0.5
    ("token_k3", 0.5, [[0, 1, 1], [1, 0, 0], [1, 0, 0]]),  # 1.61 and 0.90
    ("seq_sum_k2", 1.0, [[0, 0, 0], [1, 1, 0], [1, 0, 0]]),  # sums 1.20, 0.69, 0.02
    ("seq_mean_k2", 0.5, [[1, 1, 1], [1, 1, 0], [1, 0, 0]]),  # means 0.40, 0.34, 0.02
    ("seq_mean_k3", 0.5, [[0, 0, 0], [1, 1, 0], [1, 0, 0]]),  # means 0.60, 0.50 (0.4979), 0.02
    ("seq_max_k2", 0.7, [[0, 0, 0], [1, 1, 0], [1, 0, 0]]),  # maxima 0.96, 0.60, 0.02
    ("seq_max_k3", 1.0, [[0, 0, 0], [1, 1, 0], [1, 0, 0]]),  # maxima 1.61, 0.90, 0.02
])
def test_divergence_options_keep_what_is_below_their_bound(option, upper, kept):
    keep, m = rejection_mask(LOG_RATIO, MASK, [(option, None, upper)])
    assert keep.int().tolist() == kept
    stats = K2 if option.endswith("k2") else K3
    per_row = {"token": None, "seq_sum": [sum(r) for r in stats], "seq_mean": [sum(r) / len(r) for r in stats],
               "seq_max": [max(r) for r in stats]}[option.rsplit("_", 1)[0]]
    if per_row is None:
        assert m[f"rollout_rs_{option}_max"] == pytest.approx(max(map(max, stats)), abs=1e-4)
    else:
        assert m[f"rollout_rs_{option}_seq_max"] == pytest.approx(max(per_row), abs=1e-4)
        assert m[f"rollout_rs_{option}_seq_min"] == pytest.approx(min(per_row), abs=1e-4)
    assert f"rollout_rs_{option}_seq_fraction_low" not in m  # an upper bound only


def test_several_options_must_all_keep_a_token():
    """token_k1 on [0.6, 2.5] drops 4.0, 0.5, 3.0; seq_max_k2 <= 0.7 drops row 0: the union is dropped."""
    keep, m = rejection_mask(LOG_RATIO, MASK, [("token_k1", 0.6, 2.5), ("seq_max_k2", None, 0.7)])
    assert keep.int().tolist() == [[0, 0, 0], [1, 0, 0], [1, 0, 0]]
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(3 / 6)
    assert m["rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(3 / 6)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(4 / 6)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)


def test_batch_normalisation_makes_the_mean_weight_1():
    w, m = is_weights(LOG_RATIO, MASK, "token", None, 2.5, batch_normalize=True)  # capped 2.5, 0.5, 1, 1.5, 2.5, 0.8
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(8.8 / 6)
    assert hand(w) == pytest.approx([x * 6 / 8.8 for x in [2.5, 0.5, 1.0, 1.5, 2.5, 0.0, 0.8, 0.0, 0.0]])
    w, m = is_weights(LOG_RATIO, MASK, "sequence", None, 3.0, batch_normalize=True)  # rows 2, 3, 0.8
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(5.8 / 3)  # the mean over rows, not tokens
    assert hand(w) == pytest.approx([x * 3 / 5.8 for x in [2.0, 2.0, 2.0, 3.0, 3.0, 0.0, 0.8, 0.0, 0.0]])


def test_the_batch_function_combines_weights_mask_and_counts_by_hand():
    weights, keep, m = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="sequence", is_upper=3.0,
                                          rejection=[("token_k1", 0.6, 2.5)])
    assert weights.dtype == torch.float32
    assert hand(weights) == pytest.approx([2.0, 2.0, 2.0,  3.0, 3.0, 0.0,  0.8, 0.0, 0.0])
    assert keep.int().tolist() == [[0, 0, 1], [1, 0, 0], [1, 0, 0]]
    assert {k: m[k] for k in HAND_METRICS} == pytest.approx({
        "rollout_corr/rollout_is_ratio_fraction_high": 1 / 3,  # row 1 (4.5 > 3)
        "rollout_corr/rollout_is_ratio_fraction_low": 0.0,  # no row below 1/3
        "rollout_corr/rollout_is_mean": (3 * 2 + 2 * 3 + 0.8) / 6,
        "rollout_corr/rollout_is_max": 4.5,  # the rows' products, before the cap
        "rollout_corr/rollout_is_min": 0.8,
        "rollout_corr/rollout_is_seq_mean": (2 + 3 + 0.8) / 3,
        "rollout_corr/rollout_rs_masked_fraction": 3 / 6,
        "rollout_corr/rollout_rs_seq_masked_fraction": 2 / 3,  # rows 0 and 1 lose a token
    })
    assert m["rollout_corr_megarl/is_seq_capped_fraction"] == pytest.approx(1 / 3)  # megarl's own name


HAND_METRICS = ["rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low",
                "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min",
                "rollout_corr/rollout_is_seq_mean", "rollout_corr/rollout_rs_masked_fraction",
                "rollout_corr/rollout_rs_seq_masked_fraction"]


def test_the_batch_function_counts_tis_and_icepop_tokens_and_rows():
    _, keep, m = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="token", is_upper=2.5)
    assert torch.equal(keep, MASK.bool())  # no mask asked: every valid token kept
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 6)  # 4.0 and 3.0
    assert m["rollout_corr_megarl/is_seq_capped_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # none below 0.4
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(8.8 / 6)
    assert "rollout_corr/rollout_rs_masked_fraction" not in m
    weights, _, m = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="token", is_lower=0.6, is_upper=2.5)
    assert hand(weights) == pytest.approx([0.0, 0.0, 1.0,  1.5, 0.0, 0.0,  0.8, 0.0, 0.0])
    assert m["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(3 / 6)
    assert m["rollout_corr_megarl/is_seq_oob_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 6)  # 0.5 < 0.6
    assert "rollout_corr_megarl/is_seq_capped_fraction" not in m


def test_megarls_own_metrics_are_not_under_verls_prefix():
    _, _, tis = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="token", is_upper=2.5)
    _, _, icepop = rollout_correction(OLD, ROLLOUT, MASK, rollout_is="token", is_lower=0.6, is_upper=2.5)
    verls = {k for k in {**tis, **icepop} if k.startswith("rollout_corr/")}
    assert {k for k in {**tis, **icepop}} - verls == {"rollout_corr_megarl/is_seq_capped_fraction",
                                                      "rollout_corr_megarl/is_seq_oob_fraction"}
    for name in ("capped_fraction", "seq_capped_fraction", "seq_oob_ratio"):  # the names megarl had there
        assert f"rollout_corr/rollout_is_{name}" not in verls


def test_huge_ratios_stay_finite_and_padding_never_counts():
    old = torch.tensor([[0.0, 0.0, NAN]], dtype=torch.float64)
    rollout = torch.tensor([[-50.0, -50.0, NAN]], dtype=torch.float64)  # rho = e^50 per token
    mask = torch.tensor([[1, 1, 0]])
    w = truncated_is_weights(old - rollout, mask, "sequence", 1e30)
    assert hand(w) == pytest.approx([math.exp(20), math.exp(20), 0.0])  # clamped at e^20 as verl
    weights, keep, m = rollout_correction(old, rollout, mask, rollout_is="token", is_upper=2.0,
                                          rejection=[("seq_mean_k1", 0.5, 2.0)])
    assert weights.tolist() == [[2.0, 2.0, 0.0]] and not keep.any()
    assert all(math.isfinite(v) for v in m.values()) and m["rollout_corr/rollout_rs_masked_fraction"] == 1.0
