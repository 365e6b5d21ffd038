"""KL estimators, KL in the reward, and the KL controllers."""
import math

import pytest
import torch

from megarl.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_penalty,
    make_kl_controller,
)
from megarl.config.schema import KL_TYPES


def test_names_are_the_config_names():
    assert KL_ESTIMATORS == KL_TYPES


@pytest.mark.parametrize(
    "kl_type, expected",
    [("kl", 1.0), ("k1", 1.0), ("abs", 1.0), ("mse", 0.5), ("k2", 0.5),
     ("low_var_kl", math.exp(-1.0)), ("k3", math.exp(-1.0))],  # k3: e^-d - 1 + d at d = 1
)
def test_estimators_by_hand(kl_type, expected):
    got = kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), kl_type)
    assert got.item() == pytest.approx(expected)
    negative = kl_penalty(torch.tensor([-2.0]), torch.tensor([-1.0]), kl_type).item()  # d = -1
    assert negative == pytest.approx({"kl": -1.0, "k1": -1.0, "abs": 1.0, "mse": 0.5, "k2": 0.5}.get(kl_type, math.e - 2))


def test_k3_is_nonnegative_clamped_and_accurate_for_tiny_differences():
    gen = torch.Generator().manual_seed(0)
    log_prob = torch.randn(10000, generator=gen, dtype=torch.float64) * 10
    ref = torch.randn(10000, generator=gen, dtype=torch.float64) * 10
    k3 = kl_penalty(log_prob, ref, "k3")
    assert (k3 >= 0).all() and (k3 <= 10).all()
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([50.0]), "k3").item() == 10.0
    # exp(x) - 1 - x would lose everything here; expm1 keeps about d^2 / 2
    tiny = kl_penalty(torch.tensor([1e-6], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64), "k3")
    assert tiny.item() == pytest.approx(0.5e-12, rel=1e-5)


def test_k3_is_unbiased_for_kl():
    # KL(p || q) for two categoricals, estimated from samples of p: k1 and k3 agree with the exact value
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    exact = (p * (p / q).log()).sum().item()
    samples = torch.multinomial(p, 200000, replacement=True, generator=torch.Generator().manual_seed(0))
    for kl_type in ("k1", "k3"):
        estimate = kl_penalty(p.log()[samples], q.log()[samples], kl_type).mean().item()
        assert estimate == pytest.approx(exact, abs=0.01)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator 'full'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_apply_kl_in_reward_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, float("nan")]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.1, kl_type="kl")
    assert rewards.flatten().tolist() == pytest.approx([-0.05, 0.0, 1.05, -0.1, 2.0, 0.0])
    # per-response token-mean KL: row 1 (0.5 + 0 - 0.5) / 3 = 0, row 2 (1 + 0) / 2 = 0.5
    assert metrics == pytest.approx({"kl": 0.25, "kl_coef": 0.1})


def test_adaptive_controller_by_hand():
    ctrl = AdaptiveKLController(kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.1, n_steps=10)  # error clipped to +0.2: x (1 + 0.2 * 10 / 100)
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.045, n_steps=10)  # error -0.1: x (1 - 0.1 * 0.1)
    assert ctrl.value == pytest.approx(0.102 * 0.99)
    restored = make_kl_controller("adaptive", 1.0, target_kl=0.05, horizon=100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_controller_and_errors():
    ctrl = make_kl_controller("fixed", 0.3)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=9.0, n_steps=100)
    assert ctrl.value == 0.3
    with pytest.raises(ValueError, match="horizon=0 must be > 0"):
        make_kl_controller("adaptive", 0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="unknown KL controller type 'pid'"):
        make_kl_controller("pid", 0.1)
