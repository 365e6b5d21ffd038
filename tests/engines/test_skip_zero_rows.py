"""The actor's update leaving out the rows whose advantages are all 0
(`actor_rollout_ref.actor.skip_zero_advantage_rows`: true with the old log-probs given, auto with them made
in the update) against the same update on every row
(`false`, the oracle), on real megatron-core (CPU, gloo, DP 2; skip_rows_world.py): the weights,
the losses and the gradient norm agree to float precision, with fewer training forwards and the
same collectives, also where one rank (and one mini-batch on both ranks) has no row to learn from,
and over two interleaved pipeline stages.
"""
from collections import Counter

import pytest
import torch
from skip_rows_world import CASES, skip_batch, skip_rows_world

from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world, eight actors: about 15 s on 2 cores


@pytest.fixture(scope="module")
def run(tiny_models):
    return run_gloo_workers(skip_rows_world, 2, args=(tiny_models,), timeout_s=400)


# hand-counted from CASES (at DP 2 mini-batches of rows 0-3 | 4-7 on rank 0 and 8-11 | 12-15 on rank 1, at PP 2
# rows 0-7 | 8-15; rows of advantage 0 left out, a rank short of rows keeping its first ones): the rows each
# mini-batch trains over all ranks, and the training forwards (micro-batches of 2 rows, at VPP a multiple of PP)
# per DP rank
TRAINED_ROWS = {"mixed": ([0, 3, 9], [5, 7, 12, 14]), "idle_rank": ([0, 2, 3, 8], [4, 12]),
                "pp2_interleaved": ([0, 3, 5, 7], [8, 14])}
TRAINING_FORWARDS = {"mixed": {0: 2, 1: 2}, "idle_rank": {0: 3, 1: 2}, "pp2_interleaved": {0: 4}}
FULL_FORWARDS = {"mixed": 4, "idle_rank": 4, "pp2_interleaved": 8}


def _assert_same_weights(auto: dict, full: dict, before: dict) -> None:
    """`auto` equals `full` to float32 rounding: 1e-5 of each tensor's largest step (plain unclipped
    gradient steps: the step is the gradient) plus two ulps of its largest weight; the step moved them."""
    eps = torch.finfo(torch.float32).eps
    for key in full:
        for name in full[key]:
            step = (full[key][name] - before[key][name]).abs().max()
            bound = 1e-5 * step + 2 * eps * full[key][name].abs().max()
            assert (auto[key][name] - full[key][name]).abs().max() <= bound, name
    moved = max((full[k][n] - before[k][n]).abs().max() for k in full for n in full[k])
    assert moved > 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_skipping_zero_rows_gives_the_update_of_every_row(run, case):
    for rank in run:
        full, auto = rank[case, "false"], rank[case, "true"]
        _assert_same_weights(auto["after"], full["after"], full["before"])
        for name in ("actor/pg_loss", "actor/actor_loss", "actor/grad_norm"):
            assert auto["metrics"][name] == pytest.approx(full["metrics"][name], rel=1e-5, abs=1e-7), name
        assert full["metrics"]["actor/grad_norm"] > 0
        assert full["metrics"]["actor/rows_trained_frac"] == 1.0


@pytest.mark.parametrize("case", list(CASES))
def test_the_rows_trained_are_the_ones_with_an_advantage(run, case):
    per_dp_rank = {rank[case, "true"]["dp_rank"]: rank[case, "true"]["tokens"] for rank in run}
    tokens = torch.cat([per_dp_rank[dp] for dp in sorted(per_dp_rank)])  # each row's response tokens
    trained = TRAINED_ROWS[case]
    for rank in run:
        metrics = rank[case, "true"]["metrics"]
        assert metrics["actor/rows_trained_frac"] == sum(len(rows) / 8 for rows in trained) / 2
        assert metrics["actor/tokens"] == sum(int(tokens[rows].sum()) for rows in trained)
        assert rank[case, "false"]["metrics"]["actor/tokens"] == int(tokens.sum())
        dp = rank[case, "true"]["dp_rank"]
        assert rank[case, "true"]["forwards"]["grad"] == TRAINING_FORWARDS[case][dp]
        assert rank[case, "false"]["forwards"]["grad"] == FULL_FORWARDS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_meets_the_others_in_the_same_collectives(run, case):
    for rank in run:
        assert Counter(rank[case, "true"]["collectives"]) == Counter(rank[case, "false"]["collectives"])


def test_auto_keeps_every_row_where_a_separate_pass_made_the_old_log_probs(run):
    """Old log-probs from the trainer's own pass before the update: auto trains every row, so that the
    update's first pass recomputes them bit for bit (megarl.config.rules.skip_rows.skips_in_update)."""
    for rank in run:
        assert rank["separate_pass", "auto"]["metrics"]["actor/rows_trained_frac"] == 1.0
        assert rank["separate_pass", "auto"]["forwards"]["grad"] == FULL_FORWARDS["mixed"]


def test_old_log_probs_made_in_the_update_still_cover_every_row(run):
    advantages = skip_batch(CASES["mixed"][0])["advantages"]
    assert (advantages == 0).all(1).sum() == 9  # the rows left out of the training forward
    for rank in run:
        full, auto = rank["in_update", "false"], rank["in_update", "auto"]
        if full["scored"] is not None:
            for key in ("log_probs", "entropy"):
                torch.testing.assert_close(auto["scored"][key], full["scored"][key], rtol=1e-5, atol=1e-6)
                assert full["scored"][key].abs().sum(1).gt(0).all()
        _assert_same_weights(auto["after"], full["after"], full["before"])
        assert auto["metrics"]["actor/grad_norm"] == pytest.approx(full["metrics"]["actor/grad_norm"], rel=1e-5)
        assert auto["forwards"]["grad"] < full["forwards"]["grad"]
