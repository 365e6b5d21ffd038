"""Loss aggregation, PPO/GSPO policy loss, value loss, actor loss: by hand, properties, loop cross-check."""
import math
import typing

import pytest
import torch

from megarl.algos.kl import kl_penalty
from megarl.algos.losses import LOSS_AGG_MODES, POLICY_LOSS_MODES, actor_loss, agg_loss, policy_loss, value_loss
from megarl.config import schema

NAN = float("nan")


def test_names_are_the_config_names():
    assert LOSS_AGG_MODES == schema.LOSS_AGG_MODES
    hints = typing.get_type_hints(schema.PolicyLossConfig)
    assert POLICY_LOSS_MODES == typing.get_args(hints["loss_mode"])


# -------------------------------------------------------------------------- aggregation
LOSS = torch.tensor([[1.0, 2.0, NAN], [4.0, NAN, NAN], [NAN, NAN, NAN]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 3 has no valid token


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / (2 * 3)),
    ],
)
def test_agg_loss_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_norm_length_and_overrides():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(7 / 20)
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=14).item() == pytest.approx(0.5)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_of_nothing_is_zero(mode):
    assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_the_mini_batch_loss(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(8, 6, generator=gen) < 0.6).long()
    mask[:, 0] = 1
    full = agg_loss(loss, mask, mode)
    counts = dict(num_tokens=mask.sum().item(), num_seqs=8, norm_length=6)
    parts = [agg_loss(loss[rows], mask[rows], mode, **counts) for rows in (slice(0, 3), slice(3, 8))]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)


# -------------------------------------------------------------------------- PPO by hand
def ppo_case():
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 9.0]])
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 5.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    old = torch.full((1, 6), -1.0)
    log_prob = (old + ratios.log()).requires_grad_()
    return old, log_prob, advantages, mask


def test_ppo_loss_clip_higher_and_dual_clip_by_hand():
    old, log_prob, adv, mask = ppo_case()
    loss, m = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    # t0: A=1, r=1.5 -> clipped at 1.28: -1.28    t1: A=1, r=.5 -> -0.5 (no clip below for A>0)
    # t2: A=-1, r=.5 -> clipped at .8: 0.8        t3: A=-1, r=1.5 -> 1.5 (no clip above for A<0)
    # t4: A=-1, r=5 -> 5, dual clip bounds it at 3
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 + 3.0) / 5)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 5)
    assert m["pg_clipfrac_high"].item() == pytest.approx(1 / 5)
    assert m["pg_clipfrac_low"].item() == pytest.approx(1 / 5)
    assert m["pg_clipfrac_dual"].item() == pytest.approx(1 / 5)
    assert m["ratio_max"].item() == pytest.approx(5.0) and m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 5) / 5)
    assert m["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 5)) / 5)
    loss.backward()
    # gradient flows only through unclipped tokens: d(-A r)/d log_prob = -A r, over 5 tokens
    assert log_prob.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 5, 0.0, 1.5 / 5, 0.0, 0.0])


def test_truncated_importance_sampling_weights_each_token_by_hand():
    old, log_prob, adv, mask = ppo_case()
    # the rollout sampled t0 with probability e^-1 / 4 (weight 4, capped at 2), t1 at e^-1 * 2
    # (weight 0.5), the rest as the trainer scores them (weight 1); t5 is padding (weight 100)
    weights = torch.tensor([[4.0, 0.5, 1.0, 1.0, 1.0, 100.0]])
    rollout = old - weights.log()
    loss, m = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                          rollout_log_prob=rollout, tis_imp_ratio_cap=2.0)
    assert loss.item() == pytest.approx((2 * -1.28 + 0.5 * -0.5 + 0.8 + 1.5 + 3.0) / 5)
    assert m["tis_weight_mean"].item() == pytest.approx((2 + 0.5 + 1 + 1 + 1) / 5)
    assert m["tis_capfrac"].item() == pytest.approx(1 / 5)
    # the update's KL, as without the weights (not the rollout's)
    assert m["approx_kl"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 5)) / 5)
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([0.0, 0.5 * -0.5 / 5, 0.0, 1.5 / 5, 0.0, 0.0])
    off, m_off = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                             rollout_log_prob=rollout)  # cap -1: off, the rollout's log-probs unused
    assert off.item() == pytest.approx((-1.28 - 0.5 + 0.8 + 1.5 + 3.0) / 5) and "tis_weight_mean" not in m_off
    with pytest.raises(ValueError, match="tis_imp_ratio_cap=2.0 needs rollout_log_prob"):
        policy_loss(old, log_prob, adv, mask, tis_imp_ratio_cap=2.0)


def test_ppo_equals_vanilla_policy_gradient_at_ratio_one():
    gen = torch.Generator().manual_seed(0)
    for mode in LOSS_AGG_MODES:
        log_prob = torch.randn(4, 7, generator=gen, dtype=torch.float64).requires_grad_()
        adv = torch.randn(4, 7, generator=gen, dtype=torch.float64)
        mask = (torch.rand(4, 7, generator=gen) < 0.7).long()
        loss, m = policy_loss(log_prob.detach(), log_prob, adv, mask, loss_agg_mode=mode)
        (grad,) = torch.autograd.grad(loss, log_prob)
        reinforce = agg_loss(-adv * log_prob, mask, mode)
        (expected_grad,) = torch.autograd.grad(reinforce, log_prob)
        assert loss.item() == pytest.approx(agg_loss(-adv, mask, mode).item(), rel=1e-12)
        assert torch.allclose(grad, expected_grad, atol=1e-14)
        assert m["pg_clipfrac"].item() == 0 and m["ppo_kl"].item() == 0 and m["approx_kl"].item() == 0


def loop_ppo(old, new, adv, mask, low, high, c):
    """Token-mean clipped PPO with dual clip, written out with scalars."""
    total, count = 0.0, 0
    for o_row, n_row, a_row, m_row in zip(old, new, adv, mask):
        for o, n, a, m in zip(o_row, n_row, a_row, m_row):
            if not m:
                continue
            r = math.exp(n - o)
            term = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if a < 0:
                term = min(term, -a * c)
            total += term
            count += 1
    return total / count


@pytest.mark.parametrize("seed", range(4))
def test_ppo_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(6, 9, generator=gen, dtype=torch.float64) - 2
    new = old + 0.6 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    adv = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=gen) < 0.8).long()
    loss, m = policy_loss(old, new, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    expected = loop_ppo(old.tolist(), new.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, 3.0)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert 0 < m["pg_clipfrac"].item() < 1 and m["approx_kl"].item() > 0


def test_padding_never_reaches_the_policy_loss():
    old, log_prob, adv, mask = ppo_case()
    clean, _ = policy_loss(old, log_prob, adv, mask)
    dirty_adv = adv.masked_fill(~mask.bool(), NAN)
    dirty_old = old.masked_fill(~mask.bool(), -1e30)
    dirty, metrics = policy_loss(dirty_old, log_prob, dirty_adv, mask)
    assert dirty.item() == clean.item()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_gspo_uses_one_ratio_per_response():
    old = torch.zeros(2, 3)
    log_prob = torch.log(torch.tensor([[1.1, 1.1, 7.0], [0.8, 1.0, 7.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    loss, m = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.05, clip_ratio_high=0.05,
                          loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    # s0 = 1.1 (geometric mean) clipped to 1.05 -> -1.05; s1 = sqrt(.8) = .894 clipped to .95 -> .95
    assert loss.item() == pytest.approx((-1.05 + 0.95) / 2)
    assert m["pg_clipfrac_high"].item() == pytest.approx(0.5) and m["pg_clipfrac_low"].item() == pytest.approx(0.5)
    assert m["ratio_min"].item() == pytest.approx(math.sqrt(0.8))

    log_prob = torch.log(torch.tensor([[1.01, 1.03, 1.0]])).requires_grad_()
    loss, _ = policy_loss(torch.zeros(1, 3), log_prob, torch.ones(1, 3), torch.tensor([[1, 1, 0]]),
                          loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    s = math.sqrt(1.01 * 1.03)
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([-s / 2, -s / 2, 0.0])  # d s / d log pi_t = s / |y|


def test_gspo_clamps_only_the_sequence_log_ratio():
    """One token moved by 30 nats: the sequence log-ratio is mean(30, 0, 0, 0) = 7.5 (under the clamp
    at 10), so with A = -1 the loss at every token is e^7.5 (clipping takes the larger, unclipped
    term); clamping each token at 20 first would give e^5."""
    old = torch.tensor([[-30.5, -1.0, -1.0, -1.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-0.5, -1.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    adv, mask = -torch.ones(1, 4, dtype=torch.float64), torch.ones(1, 4)
    loss, m = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                          loss_mode="gspo", loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(math.exp(7.5), rel=1e-12)  # 1808.04
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([math.exp(7.5) / 4] * 4, rel=1e-12)
    assert m["ppo_kl"].item() == pytest.approx(-7.5)  # unclamped, as the sequence ratio uses it
    assert m["ratio_max"].item() == pytest.approx(math.exp(7.5), rel=1e-12)
    # beyond 10 only the sequence's log-ratio is clamped: mean(48, 0, 0, 0) = 12 -> e^10
    loss, m = policy_loss(old - 18.0 * torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64), log_prob.detach(),
                          adv, mask, loss_mode="gspo")
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-12) and m["ppo_kl"].item() == pytest.approx(-12.0)
    _, vanilla = policy_loss(old, log_prob.detach(), adv, mask)  # vanilla clamps each token at 20
    assert vanilla["ppo_kl"].item() == pytest.approx(-5.0)


def test_gpg_is_the_policy_gradient_by_hand():
    """L_t = -A log pi: no ratio, no clip; the old log-probs only feed the ratio metrics."""
    log_prob = torch.tensor([[-1.0, -0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-2.0, -0.5, 0.0]], dtype=torch.float64)
    adv, mask = torch.tensor([[2.0, -1.0, 9.0]], dtype=torch.float64), torch.tensor([[1, 1, 0]])
    loss, m = policy_loss(old, log_prob, adv, mask, loss_mode="gpg")
    assert loss.item() == pytest.approx((2.0 - 0.5) / 2)
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([-1.0, 0.5, 0.0])
    assert m["ppo_kl"].item() == pytest.approx(-0.5) and m["ratio_max"].item() == pytest.approx(math.e)
    assert not any(name.startswith("pg_clipfrac") for name in m)


def dppo_case(tokens):
    """(old, log_prob, advantages, mask) for tokens (A, old probability, new probability), float64,
    with one padded token of garbage after them."""
    adv = torch.tensor([[a for a, _, _ in tokens] + [9.0]], dtype=torch.float64)
    old = torch.tensor([[q for _, q, _ in tokens] + [1.0]], dtype=torch.float64).log()
    log_prob = torch.tensor([[p for _, _, p in tokens] + [0.5]], dtype=torch.float64).log().requires_grad_()
    mask = torch.tensor([[1] * len(tokens) + [0]])
    return old, log_prob, adv, mask


def test_dppo_tv_by_hand():
    """Trust region on p - q at 0.15 both ways, ratio truncated at 1.5 (t4: r = 2)."""
    tokens = [(1.0, 0.5, 0.6), (1.0, 0.5, 0.7), (-1.0, 0.5, 0.4), (-1.0, 0.5, 0.3), (1.0, 0.1, 0.2),
              (0.0, 0.5, 0.2)]  # kept, out (+0.2), kept, out (-0.2), kept and truncated, out (A = 0: -0.3)
    old, log_prob, adv, mask = dppo_case(tokens)
    loss, m = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=1.5,
                          loss_mode="dppo_tv")
    assert loss.item() == pytest.approx((-1.2 * math.log(0.6) + 0.8 * math.log(0.4) - 1.5 * math.log(0.2)) / 6)
    assert (m["pg_clipfrac"].item(), m["pg_clipfrac_high"].item(), m["pg_clipfrac_low"].item(),
            m["pg_clipfrac_dual"].item()) == pytest.approx((3 / 6, 1 / 6, 2 / 6, 1 / 6))
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([-1.2 / 6, 0, 0.8 / 6, 0, -1.5 / 6, 0, 0])


def test_dppo_kl_by_hand():
    """Trust region on the binary KL D(q || p) at 0.05, only against the advantage's push:
    D(.5 || .6) = D(.5 || .4) = .0204, D(.5 || .7) = D(.5 || .3) = .0872, D(.1 || .2) = .0367."""
    tokens = [(1.0, 0.5, 0.6), (1.0, 0.5, 0.7), (-1.0, 0.5, 0.4), (-1.0, 0.5, 0.3), (1.0, 0.1, 0.2),
              (1.0, 0.5, 0.1), (-1.0, 0.5, 0.9)]  # kept, out, kept, out, kept (r 2 -> 1.5), kept: p fell,
    old, log_prob, adv, mask = dppo_case(tokens)  # kept: p rose (r 1.8 -> 1.5)
    loss, m = policy_loss(old, log_prob, adv, mask, clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=1.5,
                          loss_mode="dppo_kl")
    assert loss.item() == pytest.approx((-1.2 * math.log(0.6) + 0.8 * math.log(0.4) - 1.5 * math.log(0.2)
                                         - 0.2 * math.log(0.1) + 1.5 * math.log(0.9)) / 7)
    assert (m["pg_clipfrac"].item(), m["pg_clipfrac_high"].item(), m["pg_clipfrac_low"].item(),
            m["pg_clipfrac_dual"].item()) == pytest.approx((2 / 7, 1 / 7, 1 / 7, 2 / 7))
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([-1.2 / 7, 0, 0.8 / 7, 0, -1.5 / 7, -0.2 / 7, 1.5 / 7, 0])


def test_policy_loss_rejects_bad_arguments():
    old, log_prob, adv, mask = ppo_case()
    with pytest.raises(ValueError, match="dual-clip bound must be > 1"):
        policy_loss(old, log_prob, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="unknown policy loss_mode 'bypass_mode'"):
        policy_loss(old, log_prob, adv, mask, loss_mode="bypass_mode")
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        policy_loss(old, log_prob, adv, mask, loss_agg_mode="mean")
    for mode, option, message in [("sapo", {"tau_neg": 0.0}, "tau_neg=0.0"),
                                  ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio=0.0"),
                                  ("kl_cov", {"kl_cov_ratio": 1.5}, "kl_cov_ratio=1.5"),
                                  ("kl_cov", {"ppo_kl_coef": -0.1}, "ppo_kl_coef=-0.1"),
                                  ("dro", {}, "dro_beta=None")]:
        with pytest.raises(ValueError, match=f"loss_mode={mode}: {message}"):
            policy_loss(old, log_prob, adv, mask, loss_mode=mode, **option)
        policy_loss(old, log_prob, adv, mask, loss_mode="vanilla", **option)  # not read by other modes


# -------------------------------------------------------------------------- value and actor losses
def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.0, 2.0, NAN]])
    old = torch.tensor([[0.5, 0.5, 0.0]])
    returns = torch.tensor([[1.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(vpreds, returns, old, mask, cliprange_value=0.2)
    # t0: (1 - 1.5)^2 = .25 vs clipped (0.7 - 1.5)^2 = .64 -> .64;  t1: (2 - 0)^2 = 4 vs (.7)^2 -> 4
    assert loss.item() == pytest.approx(0.5 * (0.64 + 4.0) / 2)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    assert m["vpred_mean"].item() == pytest.approx(1.5)


def test_actor_loss_combines_policy_entropy_and_kl():
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(3, 5, generator=gen) - 1
    log_prob = (old + 0.1 * torch.randn(3, 5, generator=gen)).requires_grad_()
    ref = old + 0.2 * torch.randn(3, 5, generator=gen)
    adv = torch.randn(3, 5, generator=gen)
    entropy = torch.rand(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    mode = "seq-mean-token-mean"
    loss, m = actor_loss(log_prob, old, adv, mask, entropy=entropy, ref_log_prob=ref, loss_agg_mode=mode,
                         entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3")
    pg, _ = policy_loss(old, log_prob, adv, mask, loss_agg_mode=mode)
    ent = agg_loss(entropy, mask, mode)
    kl = agg_loss(kl_penalty(log_prob, ref, "k3"), mask, mode)
    assert loss.item() == pytest.approx((pg - 0.01 * ent + 0.05 * kl).item(), rel=1e-6)
    assert m["entropy"].item() == pytest.approx(ent.item()) and m["kl_loss"].item() == pytest.approx(kl.item())
    assert m["actor_loss"].item() == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="needs ref_log_prob"):
        actor_loss(log_prob, old, adv, mask, use_kl_loss=True)
    with pytest.raises(ValueError, match="entropy_coeff=0.01 needs the per-token entropy"):
        actor_loss(log_prob, old, adv, mask, entropy_coeff=0.01)
