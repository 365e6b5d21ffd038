"""Activation recompute in the megatron engine (CPU, gloo, 2 ranks at TP1 x PP2; recompute_world.py):
full (uniform by 1 and by 2 layers, block of 1 layer) and selective recompute give the same old
log-probs, update metrics and weights after the update as the same step without recompute, bit for
bit; and the recompute runs, seen in megatron's checkpointed forward: each recomputed part runs once
without autograd in the forward pass and once with it in the backward pass. In the same world,
verl's old-log-prob keys (`rollout.log_prob_use_dynamic_bsz`, `log_prob_max_token_len_per_gpu`) cut
that pass by tokens.

Exact, not within rounding: on CPU in fp32, megatron's `CheckpointFunction` replays the same ops on
the same inputs in the same order (with the RNG states restored; dropout is 0 anyway), so the
recomputed activations, and the gradients from them, are the same floats.
"""
import pytest
import torch
from engine_world import training_batch
from recompute_world import CASES, CRITIC_CASES, OLD_LOG_PROB_BUDGET, recompute_world

from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world, six actors and two critics: about 25 s on 2 cores

MICRO_BATCHES = 4  # 8 samples in micro-batches of 2 (engine_world.config), one mini-batch
# case -> (layer, core attention) runs without autograd per micro-batch of the update, for the two layers of a stage
RECOMPUTED = {
    "none": ((0, 0), (0, 0)),
    "gradient_checkpointing": ((1, 1), (1, 1)),
    "uniform_2": ((1, 1), (1, 1)),
    "block_1": ((1, 1), (0, 0)),  # the first recompute_num_layers=1 layer of each stage only
    "selective": ((0, 1), (0, 1)),  # core attention inside each layer only
}
SETTINGS = {
    "none": (None, None, None),
    "gradient_checkpointing": ("full", "uniform", 1),
    "uniform_2": ("full", "uniform", 2),
    "block_1": ("full", "block", 1),
    "selective": ("selective", None, None),
}


@pytest.fixture(scope="module")
def run(tiny_models):
    return run_gloo_workers(recompute_world, 2, args=(tiny_models,), timeout_s=500)


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


@pytest.mark.parametrize("case", [c for c in CASES if c != "none"])
def test_recompute_gives_the_same_step_bit_for_bit(run, case):
    for rank in run:
        base, mine = rank["actor"]["none"], rank["actor"][case]
        assert mine["metrics"] == base["metrics"]
        assert _equal_states(mine["state"], base["state"])
        if base["scored"] is not None:  # the output rank (last stage)
            assert torch.equal(mine["scored"]["log_probs"], base["scored"]["log_probs"])
            assert torch.equal(mine["scored"]["entropy"], base["scored"]["entropy"])
    first = run[0]["actor"]["none"]
    assert first["metrics"]["actor/grad_norm"] > 0 and first["metrics"]["actor/kl_loss"] != 0


@pytest.mark.parametrize("case", list(CASES))
def test_recompute_runs_as_configured(run, case):
    for rank in run:
        mine = rank["actor"][case]
        s = mine["settings"]
        assert (s["recompute_granularity"], s["recompute_method"], s["recompute_num_layers"]) == SETTINGS[case]
        assert mine["micro_batches"] == MICRO_BATCHES
        for i, (layer, core_attn) in enumerate(RECOMPUTED[case]):
            # every part runs once with autograd per micro-batch (the forward, or its recompute)
            assert mine["counts"][("layer", i)] == {"grad": MICRO_BATCHES, "no_grad": layer * MICRO_BATCHES}
            assert mine["counts"][("core_attn", i)] == {"grad": MICRO_BATCHES, "no_grad": core_attn * MICRO_BATCHES}


def test_the_critics_own_overrides_recompute_it_exactly(run):
    assert list(CRITIC_CASES) == ["none", "full"]
    for rank in run:
        base, full = rank["critic"]["none"], rank["critic"]["full"]
        assert full["settings"]["recompute_granularity"] == "full"
        assert base["settings"]["recompute_granularity"] is None
        assert full["metrics"] == base["metrics"] and _equal_states(full["state"], base["state"])
        assert all(c["no_grad"] == MICRO_BATCHES for key, c in full["counts"].items() if key[0] == "layer")
        if base["values"] is not None:
            assert torch.equal(full["values"]["values"], base["values"]["values"])


def test_the_old_log_prob_pass_takes_verls_token_budget(run):
    """rollout.log_prob_micro_batch_size_per_gpu=8 alone would score the 8 samples in one forward;
    the budget of 30 tokens needs at least ceil(total tokens / 30) of them. The log-probs are the
    baseline's (micro-batches of 2), to float rounding (other padding, other matmul shapes)."""
    tokens = int(training_batch().token_lengths().sum())
    for rank in run:
        assert rank["old_log_probs"]["forwards"] >= -(-tokens // OLD_LOG_PROB_BUDGET) > 1
        if rank["old_log_probs"]["scored"] is not None:
            torch.testing.assert_close(rank["old_log_probs"]["scored"]["log_probs"],
                                       rank["actor"]["none"]["scored"]["log_probs"], rtol=1e-5, atol=1e-6)
