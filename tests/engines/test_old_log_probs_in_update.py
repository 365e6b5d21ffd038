"""The old log-probs made inside the actor's update (`update_policy_with_old_log_probs`) against
the controller's separate pass (`compute_log_prob`, then `update_policy`), on real megatron-core
(CPU, gloo, 2 ranks; old_log_probs_world.py): at DP2 and PP2 with the mini-batches cut like the
log-prob pass, everything is equal bit for bit; at TP2 with shuffled mini-batches, two epochs,
token budgets, a KL loss and an entropy bonus, equal to float precision. The separate pass is
itself checked against HF's log-probs in test_megatron_engine.py.
"""
from collections import Counter

import pytest
import torch
from old_log_probs_world import LAYOUTS, STEPS, old_log_probs_world

from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world, six actors: about 30 s on 2 cores


@pytest.fixture(scope="module")
def run(tiny_models):
    return run_gloo_workers(old_log_probs_world, 2, args=(tiny_models,), timeout_s=500)


def _scored(run, layout, path, step):
    """The output ranks' old log-probs and entropies of `step`, joined in DP order."""
    parts = sorted((rank[layout][path]["dp_rank"], rank[layout][path]["scored"][step]) for rank in run
                   if rank[layout][path]["scored"][step] is not None)
    return {key: torch.cat([p[key] for _, p in parts]) for key in ("log_probs", "entropy")}


@pytest.mark.parametrize("layout", ["dp2_aligned", "pp2_aligned"])
def test_aligned_micro_batches_give_the_separate_pass_bit_for_bit(run, layout):
    for step in range(STEPS):
        separate, in_update = _scored(run, layout, "separate", step), _scored(run, layout, "in_update", step)
        assert torch.equal(separate["log_probs"], in_update["log_probs"]), step
        assert torch.equal(separate["entropy"], in_update["entropy"]), step
        assert separate["log_probs"].abs().sum() > 0
    for rank in run:
        assert rank[layout]["in_update"]["metrics"] == rank[layout]["separate"]["metrics"]
        for a, b in zip(rank[layout]["separate"]["states"], rank[layout]["in_update"]["states"]):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k][name], b[k][name]) for k in a for name in a[k])
    for rank in run:  # the first mini-batch's rows (2 of 4 at DP2, 4 of 8 at PP2) were not scored apart
        separate, in_update = rank[layout]["separate"]["forwards"], rank[layout]["in_update"]["forwards"]
        assert in_update["grad"] == separate["grad"] > 0
        assert in_update["no_grad"] == separate["no_grad"] // 2 > 0
    first, second = (run[0][layout]["separate"]["states"][i] for i in range(2))
    assert any(not torch.equal(first[k][n], second[k][n]) for k in first for n in first[k])  # the steps trained


def test_shuffled_epochs_and_token_budgets_agree_to_float_precision(run):
    layout = "tp2_shuffled"
    assert LAYOUTS[layout][0] == 2
    for step in range(STEPS):
        separate, in_update = _scored(run, layout, "separate", step), _scored(run, layout, "in_update", step)
        torch.testing.assert_close(in_update["log_probs"], separate["log_probs"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(in_update["entropy"], separate["entropy"], rtol=1e-5, atol=1e-6)
    for rank in run:
        for a, b in zip(rank[layout]["separate"]["metrics"], rank[layout]["in_update"]["metrics"]):
            assert a.keys() == b.keys()
            for name in a:
                assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name
        state_a, state_b = rank[layout]["separate"]["states"][-1], rank[layout]["in_update"]["states"][-1]
        for k in state_a:
            for name in state_a[k]:
                torch.testing.assert_close(state_b[k][name], state_a[k][name], rtol=1e-4, atol=1e-6)


def test_the_callers_batch_is_left_as_it_was(run):
    for rank in run:
        for layout in LAYOUTS:
            assert rank[layout]["in_update"]["batch_unchanged"]


def test_an_update_at_dp2_meets_the_other_rank_at_nine_collectives(run):
    """Hand-counted for dp2_aligned's update (two mini-batches of one micro-batch each, no
    distributed optimizer): the sample-count check and the global counts of both mini-batches
    before training; per mini-batch the gradient all-reduce, the non-finite check and the
    gradient norm; the loss metrics of both mini-batches at the end. Folding per-mini-batch
    calls into one per update took it from 13; a new collective per step shows up here.
    megatron-core 0.19 adds one of its own in the first update only (`has_grad_norm_group`: one
    global reduction, cached after, optimizer.py), which 0.16.1 does not make."""
    import megatron.core
    from packaging.version import Version

    expected = {
        ("all_reduce", "megarl.engines.megatron.training:check_mini_batches"): 1,
        ("all_reduce", "megarl.engines.megatron.training:global_counts"): 1,
        ("all_reduce", "megatron.core.distributed.param_and_grad_buffer:start_grad_sync"): 2,
        ("all_reduce", "megarl.engines.megatron.training:grads_finite"): 2,
        ("all_reduce", "megatron.core.optimizer.clip_grads:get_grad_norm_fp32"): 2,
        ("all_gather", "megarl.engines.megatron.metrics:reduce_over_micro_batches"): 1,
    }
    first_only = {("all_reduce", "megatron.core.optimizer.optimizer:has_grad_norm_group"): 1} \
        if Version(megatron.core.__version__) >= Version("0.19") else {}
    for rank in run:
        for update, calls in enumerate(rank["dp2_aligned"]["in_update"]["collectives"]):
            where = Counter((name, caller.split(" <- ")[-1]) for name, caller in calls)
            assert where == (expected | first_only if update == 0 else expected)
