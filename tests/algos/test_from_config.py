"""Config sections map onto the algos keyword arguments, and those calls run."""
import torch

from megarl.algos import actor_loss, compute_advantages, value_loss
from megarl.algos.from_config import actor_loss_kwargs, advantage_kwargs, kl_controller, value_loss_kwargs
from megarl.algos.kl import AdaptiveKLController
from megarl.config import load_config


def test_config_to_kwargs_and_calls():
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false",
        "actor_rollout_ref.actor.clip_ratio=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "algorithm.kl_ctrl.type=adaptive",
        "critic.cliprange_value=0.3",
    ])
    kwargs = actor_loss_kwargs(cfg.actor_rollout_ref.actor)
    assert (kwargs["clip_ratio_low"], kwargs["clip_ratio_high"], kwargs["loss_mode"]) == (0.2, 0.28, "gspo")
    assert advantage_kwargs(cfg.algorithm) == {"gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": False}
    assert value_loss_kwargs(cfg.critic) == {"cliprange_value": 0.3, "loss_agg_mode": "token-mean"}
    ctrl = kl_controller(cfg.algorithm.kl_ctrl)
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == cfg.algorithm.kl_ctrl.kl_coef

    mask = torch.ones(2, 3)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv = compute_advantages(cfg.algorithm.adv_estimator, rewards, mask, uids=["u", "u"],
                             **advantage_kwargs(cfg.algorithm)).advantages
    log_prob = torch.zeros(2, 3, requires_grad=True)
    loss, _ = actor_loss(log_prob, log_prob.detach(), adv, mask, ref_log_prob=torch.zeros(2, 3), **kwargs)
    assert loss.item() == 0.0  # ratio 1 and advantages +-0.5 over equal lengths cancel
    vloss, _ = value_loss(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3), mask, **value_loss_kwargs(cfg.critic))
    assert vloss.item() == 0.5
