"""megarl's GPG and DPPO against verl 0.9.1's own code: the policy losses `gpg`, `dppo_tv`,
`dppo_kl` (`compute_policy_loss_*` of its core_algos.py) on random float32 batches with masks,
rows without a valid token, zero advantages and rollout IS weights, under every loss_agg_mode,
the mini-batch's counts passed as verl's engine passes them: loss, gradient and verl's metrics
within float32 tolerance; GPG's advantage (`compute_gpg_outcome_advantage`); and bypass mode's
loss, which replaces any loss_mode, as verl's. verl is loaded from its wheel by the `verl` fixture
of test_rollout_correction_verl.py (its functions executed from the zip, unchanged)."""
import sys
from pathlib import Path
from unittest import mock

import numpy
import pytest
import torch

from megarl.algos.advantages import compute_advantages
from megarl.algos.from_config import bypass_kwargs
from megarl.algos.losses import LOSS_AGG_MODES, actor_loss, policy_loss
from megarl.config import load_and_validate

sys.path.insert(0, str(Path(__file__).parent))  # verl's wheel as the rollout-correction tests load it
from test_rollout_correction_verl import REQUIRED, RC, ActorConfig, verl  # noqa: E402,F401  (verl: the fixture)

RTOL, ATOL = 1e-5, 1e-6  # float32
CLIPS = {"gpg": (0.2, 0.28, 3.0), "dppo_tv": (0.15, 0.15, 1.5), "dppo_kl": (0.05, 0.05, 1.5)}  # low, high, c


def random_batch(seed: int, rows: int = 12, width: int = 10):
    """(old, new, advantages, mask, weights) float32 [rows, width]: log-probs in [-3, 0) moved by
    ~N(0, 0.5) nats (kept below 0: probabilities), advantages ~N(0, 1) with a fifth exactly 0, rows
    3 and 8 without a valid token, positive IS weights; padding holds values like the rest."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    lengths[[3, 8]] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    old = -3.0 * torch.rand(rows, width, generator=g)
    new = torch.clamp(old + 0.5 * torch.randn(rows, width, generator=g), max=-1e-3)
    advantages = torch.randn(rows, width, generator=g)
    advantages[torch.rand(rows, width, generator=g) < 0.2] = 0.0
    weights = torch.exp(0.3 * torch.randn(rows, width, generator=g))
    return old, new, advantages, mask, weights


def counts(mask: torch.Tensor) -> dict:
    return {"num_tokens": float(mask.sum()), "num_seqs": float(mask.any(-1).sum())}


def verls_policy_loss(verl, loss_mode, old, new, advantages, mask, loss_agg_mode, weights=None):
    low, high, c = CLIPS[loss_mode]
    n = counts(mask)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                        global_batch_info={"dp_size": 1, "batch_num_tokens": n["num_tokens"],
                                           "global_batch_size": n["num_seqs"]})
    log_prob = new.clone().requires_grad_(True)
    with mock.patch.dict(sys.modules, verl.modules):
        loss, metrics = verl.losses[f"compute_policy_loss_{loss_mode}"](
            old, log_prob, advantages, mask.float(), loss_agg_mode=loss_agg_mode, config=actor,
            rollout_is_weights=weights)
    loss.backward()
    return loss, log_prob.grad, metrics


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["gpg", "dppo_tv", "dppo_kl"])
def test_the_policy_loss_its_gradient_and_metrics_are_verls(verl, loss_mode, loss_agg_mode, with_weights):
    old, new, advantages, mask, weights = random_batch(1)
    weights = weights if with_weights else None
    low, high, c = CLIPS[loss_mode]
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = policy_loss(old, log_prob, advantages, mask,
                                clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, loss_mode=loss_mode,
                                loss_agg_mode=loss_agg_mode, rollout_is_weights=weights, **counts(mask))
    loss.backward()
    their_loss, their_grad, their_metrics = verls_policy_loss(verl, loss_mode, old, new, advantages, mask,
                                                              loss_agg_mode, weights)

    assert loss.item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
    torch.testing.assert_close(log_prob.grad, their_grad, rtol=RTOL, atol=1e-8)
    assert log_prob.grad.abs().sum() > 0
    assert metrics["pg_loss"].item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
    if loss_mode == "gpg":
        assert their_metrics == {}
        assert "pg_clipfrac" not in metrics
        return
    assert metrics["ppo_kl"].item() == pytest.approx(their_metrics["actor/ppo_kl"], rel=RTOL, abs=ATOL)
    assert metrics["pg_clipfrac"].item() == pytest.approx(their_metrics["actor/pg_clipfrac"], abs=ATOL)
    assert metrics["pg_clipfrac_dual"].item() == pytest.approx(their_metrics["actor/pg_clipfrac_lower"], abs=ATOL)
    # the batch reaches every branch: tokens out of the region on both sides, ratios truncated
    assert 0 < metrics["pg_clipfrac_high"].item() and 0 < metrics["pg_clipfrac_low"].item()
    assert metrics["pg_clipfrac"].item() == pytest.approx(
        metrics["pg_clipfrac_high"].item() + metrics["pg_clipfrac_low"].item())
    assert 0 < metrics["pg_clipfrac_dual"].item()


@pytest.mark.parametrize("loss_mode", ["gspo", "gpg", "dppo_tv"])
def test_bypass_mode_replaces_the_loss_mode_as_verls(verl, loss_mode):
    """With algorithm.rollout_correction.bypass_mode (loss_type=ppo_clip) the actor's loss is verl's
    `compute_policy_loss_bypass_mode`, PPO against the rollout's log-probs, whatever loss_mode says
    (verl's `apply_bypass_mode` sets loss_mode="bypass_mode")."""
    rollout, new, advantages, mask, _ = (t.double() for t in random_batch(2))
    mask = mask.long()
    cfg = load_and_validate(None, REQUIRED + [f"{RC}.bypass_mode=true"]).algorithm.rollout_correction
    log_prob = new.clone().requires_grad_(True)
    loss, _ = actor_loss(log_prob, rollout, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         loss_mode=loss_mode, bypass=bypass_kwargs(cfg), **counts(mask))
    loss.backward()
    their_log_prob = new.clone().requires_grad_(True)
    n = counts(mask)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                        policy_loss={"rollout_correction": verl.config(bypass_mode=True, loss_type="ppo_clip")},
                        global_batch_info={"dp_size": 1, "batch_num_tokens": n["num_tokens"],
                                           "global_batch_size": n["num_seqs"]})
    with mock.patch.dict(sys.modules, verl.modules):
        their_loss, _ = verl.losses["compute_policy_loss_bypass_mode"](
            rollout, their_log_prob, advantages, mask.double(), loss_agg_mode="token-mean", config=actor)
    their_loss.backward()
    assert loss.item() == pytest.approx(their_loss.item(), rel=1e-9)
    torch.testing.assert_close(log_prob.grad, their_log_prob.grad, rtol=1e-9, atol=1e-12)


def groups(seed: int, num_groups: int = 6, discrete: bool = True):
    """(rewards, mask, uids): groups of 2-5 responses in shuffled order, an outcome score on each
    response's last valid token (0/1/2 or continuous; one group all equal), float32."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 6, (num_groups,), generator=g).tolist()
    uids = [f"p{k}" for k, size in enumerate(sizes) for _ in range(size)]
    order = torch.randperm(len(uids), generator=g).tolist()
    uids = [uids[i] for i in order]
    scores = (torch.randint(0, 3, (len(uids),), generator=g).float() if discrete
              else torch.randn(len(uids), generator=g))
    scores[[i for i, uid in enumerate(uids) if uid == "p0"]] = 1.0
    width = 7
    lengths = torch.randint(1, width + 1, (len(uids),), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    rewards = torch.zeros(len(uids), width)
    rewards[torch.arange(len(uids)), lengths - 1] = scores
    return rewards, mask, uids


@pytest.mark.parametrize("discrete", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_advantages_are_verls(verl, seed, discrete):
    rewards, mask, uids = groups(seed, discrete=discrete)
    ours = compute_advantages("gpg", rewards, mask, uids=uids)
    theirs, their_returns = verl.losses["compute_gpg_outcome_advantage"](rewards, mask, numpy.array(uids))
    torch.testing.assert_close(ours.advantages, theirs, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours.returns, their_returns, rtol=RTOL, atol=ATOL)
    assert ours.advantages.abs().max() > 1.0  # alpha scales the centred scores
    assert ours.metrics["num_uniform_groups"] >= 1


def test_a_group_of_one_gets_0_where_verl_gives_alpha_times_its_score(verl):
    """megarl's rule for every group estimator (the `megarl.algos` docstring): a lone response
    has no baseline and gets advantage 0; verl's code takes mean 0 there."""
    rewards, mask, uids = groups(3)
    rewards = torch.cat([rewards, torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])])
    mask, uids = torch.cat([mask, torch.tensor([[1, 1, 0, 0, 0, 0, 0]])]), uids + ["lone"]
    ours = compute_advantages("gpg", rewards, mask, uids=uids)
    theirs, _ = verl.losses["compute_gpg_outcome_advantage"](rewards, mask, numpy.array(uids))
    alpha = len(uids) / int(rewards.sum(-1).count_nonzero())
    assert theirs[-1, :2].tolist() == pytest.approx([2.0 * alpha] * 2)
    assert ours.advantages[-1].eq(0).all()
    torch.testing.assert_close(ours.advantages[:-1], theirs[:-1], rtol=RTOL, atol=ATOL)
