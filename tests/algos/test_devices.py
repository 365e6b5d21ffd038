"""float32 inputs on every available device (CPU, and CUDA where present) give results on that
device that agree with the float64 CPU computation: no hidden device moves, enough precision."""
import pytest
import torch

from megarl.algos import (
    actor_loss,
    agg_loss,
    apply_kl_in_reward,
    compute_advantages,
    dpo_loss,
    entropy_from_logits,
    kl_penalty,
    overlong_penalty,
    value_loss,
)
from megarl.algos.losses import LOSS_AGG_MODES, POLICY_LOSS_MODES
from megarl.config.schema import ADV_ESTIMATORS
from megarl.rewards.batch import token_level_scores

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def inputs():
    gen = torch.Generator().manual_seed(7)
    batch, length = 12, 16
    mask = (torch.arange(length)[None, :] < torch.randint(1, length + 1, (batch, 1), generator=gen)).long()
    return {
        "rewards": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "values": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "old": torch.randn(batch, length, generator=gen, dtype=torch.float64) - 2,
        "delta": 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "logits": 5 * torch.randn(batch, length, 64, generator=gen, dtype=torch.float64),
        "baselines": torch.randn(batch, generator=gen, dtype=torch.float64),
        "mask": mask,
        "uids": [f"p{i // 4}" for i in range(batch)],
    }


def on(device, tensor):
    return tensor.to(device, torch.float32 if tensor.is_floating_point() else tensor.dtype)


def close(got, reference, device, atol=1e-4):
    assert got.device.type == device
    assert torch.allclose(got.cpu().double(), reference.cpu().double(), atol=atol, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("estimator", ADV_ESTIMATORS)
def test_advantages(device, estimator):
    x = inputs()
    kwargs = dict(uids=x["uids"], gamma=0.99, lam=0.95)
    ref = compute_advantages(estimator, x["rewards"], x["mask"], values=x["values"],
                             reward_baselines=x["baselines"], **kwargs)
    got = compute_advantages(estimator, on(device, x["rewards"]), x["mask"].to(device),
                             values=on(device, x["values"]), reward_baselines=on(device, x["baselines"]), **kwargs)
    close(got.advantages, ref.advantages, device)
    close(got.returns, ref.returns, device)
    assert got.metrics == ref.metrics


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", POLICY_LOSS_MODES)
def test_actor_and_value_losses(device, mode, loss_mode):
    x = inputs()
    entropy = entropy_from_logits(x["logits"])
    kwargs = dict(loss_agg_mode=mode, loss_mode=loss_mode, clip_ratio_high=0.28, entropy_coeff=0.01,
                  use_kl_loss=True, kl_loss_type="low_var_kl", mode_options={"dro_beta": 0.5})

    def run(dev, cast):
        torch.manual_seed(0)  # clip_cov's draw: torch's CPU generator on every device
        new = cast(x["old"] + x["delta"]).requires_grad_()
        loss, metrics = actor_loss(new, cast(x["old"]), cast(x["values"]), x["mask"].to(dev),
                                   entropy=cast(entropy), ref_log_prob=cast(x["old"] - x["delta"]), **kwargs)
        loss.backward()
        vloss, vmetrics = value_loss(cast(x["values"]), cast(x["rewards"]), cast(x["old"]), x["mask"].to(dev),
                                     cliprange_value=0.2, loss_agg_mode=mode)
        return loss, new.grad, metrics, vloss, vmetrics

    ref = run("cpu", lambda t: t.clone())
    got = run(device, lambda t: on(device, t))
    for g, r in zip(got[:2] + got[3:4], ref[:2] + ref[3:4]):
        close(g, r, device)
    for metrics, ref_metrics in ((got[2], ref[2]), (got[4], ref[4])):
        assert metrics.keys() == ref_metrics.keys()
        for key in metrics:
            close(metrics[key], ref_metrics[key], device)


@pytest.mark.parametrize("device", DEVICES)
def test_entropy_kl_dpo_dapo_and_token_scores(device):
    x = inputs()
    close(entropy_from_logits(on(device, x["logits"])), entropy_from_logits(x["logits"]), device)
    close(entropy_from_logits(on(device, x["logits"]).bfloat16()), entropy_from_logits(x["logits"]), device, 0.1)
    new, old = x["old"] + x["delta"], x["old"]
    for kl_type in ("k1", "abs", "k2", "k3"):
        close(kl_penalty(on(device, new), on(device, old), kl_type), kl_penalty(new, old, kl_type), device)
    got, got_metrics = apply_kl_in_reward(on(device, x["rewards"]), on(device, new), on(device, old),
                                          x["mask"].to(device), kl_coef=0.1)
    ref, ref_metrics = apply_kl_in_reward(x["rewards"], new, old, x["mask"], kl_coef=0.1)
    close(got, ref, device)
    assert got_metrics == pytest.approx(ref_metrics, abs=1e-5)
    sums = [on(device, t) for t in (new[:, 0], new[:, 1], old[:, 0], old[:, 1])]
    loss, _ = dpo_loss(*sums)
    close(loss, dpo_loss(new[:, 0], new[:, 1], old[:, 0], old[:, 1])[0], device)
    lengths = x["mask"].sum(-1)
    close(overlong_penalty(lengths.to(device), 16, 4), overlong_penalty(lengths, 16, 4), device)
    close(token_level_scores(on(device, x["baselines"]), x["mask"].to(device)),
          token_level_scores(x["baselines"], x["mask"]), device)
    close(agg_loss(on(device, x["rewards"]), x["mask"].to(device), "token-mean", num_tokens=100),
          agg_loss(x["rewards"], x["mask"], "token-mean", num_tokens=100), device)
