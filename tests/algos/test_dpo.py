"""DPO losses by hand."""
import math

import pytest
import torch

from megarl.algos.dpo import dpo_loss

PC, PR, RC, RR = torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5])


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


def test_sigmoid_by_hand():
    # h = (-1 + 1.5) - (-2 + 1.5) = 1, beta h = 0.5
    loss, m = dpo_loss(PC, PR, RC, RR, beta=0.5)
    assert loss.item() == pytest.approx(-log_sigmoid(0.5))
    assert m["rewards_chosen"].item() == pytest.approx(0.25) and m["rewards_rejected"].item() == pytest.approx(-0.25)
    assert m["reward_margin"].item() == pytest.approx(0.5) and m["reward_accuracy"].item() == 1.0


def test_label_smoothing_and_ipo_by_hand():
    loss, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, label_smoothing=0.1)
    assert loss.item() == pytest.approx(-0.9 * log_sigmoid(0.5) - 0.1 * log_sigmoid(-0.5))
    ipo, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo")  # (h - 1 / (2 beta))^2 = (1 - 1)^2
    assert ipo.item() == pytest.approx(0.0)
    ipo, _ = dpo_loss(PC, PR, RC, RR, beta=0.25, loss_type="ipo")
    assert ipo.item() == pytest.approx((1 - 2) ** 2)


def test_gradient_pushes_chosen_up_and_rejected_down():
    chosen = torch.tensor([-3.0, -2.0], requires_grad=True)
    rejected = torch.tensor([-3.0, -1.0], requires_grad=True)
    loss, _ = dpo_loss(chosen, rejected, torch.tensor([-3.0, -2.0]), torch.tensor([-3.0, -1.0]))
    loss.backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


def test_errors():
    with pytest.raises(ValueError, match="unknown DPO loss_type 'hinge'"):
        dpo_loss(PC, PR, RC, RR, loss_type="hinge")
    with pytest.raises(ValueError, match="beta=0 must be > 0"):
        dpo_loss(PC, PR, RC, RR, beta=0)
