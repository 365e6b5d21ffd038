"""Metrics declare how each value combines over micro-batches; the losses declare theirs."""
import pytest
import torch

from megarl.algos.losses import actor_loss, value_loss
from megarl.algos.metrics import Metrics, Reduction


def test_metrics_read_like_a_dict_and_keep_each_reduction():
    metrics = Metrics()
    metrics.add("loss", torch.tensor(2.0, requires_grad=True) * 1, Reduction.SUM)
    metrics.add("peak", torch.tensor(3.0), Reduction.MAX)
    assert list(metrics) == ["loss", "peak"] and metrics["peak"].item() == 3.0 and len(metrics) == 2
    more = Metrics()
    more.update(metrics)
    copy = more.cloned()
    assert [copy.reduction(n) for n in copy] == [Reduction.SUM, Reduction.MAX]
    assert not copy["loss"].requires_grad and copy["loss"].data_ptr() != metrics["loss"].data_ptr()
    with pytest.raises(TypeError, match="'peak': reduction must be a Reduction"):
        metrics.add("peak", torch.tensor(1.0), "max")


def test_losses_declare_their_metrics_reductions():
    gen = torch.Generator().manual_seed(0)
    log_prob, old, ref, adv = (torch.randn(3, 4, generator=gen) for _ in range(4))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    _, metrics = actor_loss(log_prob, old, adv, mask, entropy=torch.rand(3, 4, generator=gen), ref_log_prob=ref,
                            use_kl_loss=True, rollout_log_prob=old - 0.1, tis_imp_ratio_cap=2.0)
    _, value_metrics = value_loss(log_prob, adv, old, mask, cliprange_value=0.2)
    declared = {name: m.reduction(name) for m in (metrics, value_metrics) for name in m}
    special = {"pg_loss": Reduction.SUM, "entropy": Reduction.SUM, "kl_loss": Reduction.SUM,
               "actor_loss": Reduction.SUM, "vf_loss": Reduction.SUM, "ratio_max": Reduction.MAX,
               "ratio_min": Reduction.MIN, "kl_coef": Reduction.CONSTANT}
    assert declared == {name: special.get(name, Reduction.TOKEN_MEAN) for name in declared}
    assert {"pg_clipfrac", "ppo_kl", "tis_capfrac", "vf_clipfrac", "vpred_mean"} <= declared.keys()
