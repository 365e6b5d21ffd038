"""Routing replay (R3) with activation recompute under pipelining (CPU, gloo, 2 ranks at TP1 x PP2,
and PP2 x VPP2; replay_recompute_world.py): full recompute (and selective of the MoE layer) gives
the same update metrics (loss, grad norm) and weights after the update as the same replayed step
without recompute, bit for bit; and every routing decision of every router, in the forward pass
and in the backward pass's recompute, is the one fed in for its micro-batch, checked against the
routes the test made, laid out by hand (padded layout: position s of sample j of a micro-batch at
router row s * 2 + j). With 1F1B, stage 0 runs micro-batch 1's forward before micro-batch 0's
backward: a recompute that took the last target set would replay micro-batch 1's routes there.

Exact, not within rounding: on CPU in fp32 megatron's checkpointed forward replays the same ops on
the same inputs (test_recompute.py), here with the same routes.
"""
import pytest
import torch
from replay_recompute_world import LAYERS, PROMPT, RESPONSE, TOPK, replay_recompute_world

from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank megatron world, five actors

MICRO_BATCHES, PER_MICRO_BATCH = 4, 2
BASELINE = {"full": "none", "moe": "none", "vpp_full": "vpp_none"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = make_tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe", layers=LAYERS, hidden=64,
                                heads=4, kv_heads=2, intermediate=32, seed=3)
    return run_gloo_workers(replay_recompute_world, 2, args=(str(model_dir),), timeout_s=400)


def expected_routes(sample_routes: list, micro_batch: int, layer: int) -> torch.Tensor:
    """[S * 2, K] the experts (ascending) a router of `layer` must choose per row for `micro_batch`:
    sample j's token s at row s * 2 + j; its last token (no route recorded) experts 0..K-1."""
    length = PROMPT + RESPONSE
    out = torch.zeros(length * PER_MICRO_BATCH, TOPK, dtype=torch.long)
    for j in range(PER_MICRO_BATCH):
        routes = sample_routes[micro_batch * PER_MICRO_BATCH + j]
        for s in range(length):
            out[s * PER_MICRO_BATCH + j] = (routes[s, layer].long().sort().values if s < length - 1
                                            else torch.arange(TOPK))
    return out


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])


@pytest.mark.parametrize("case", list(BASELINE))
def test_recompute_with_replay_gives_the_same_step_bit_for_bit(run, case):
    for rank in run:
        base, mine = rank[BASELINE[case]], rank[case]
        assert mine["metrics"] == base["metrics"]
        assert _equal_states(mine["state"], base["state"])
    assert run[0]["none"]["metrics"]["actor/grad_norm"] > 0


@pytest.mark.parametrize("case", ["none", "vpp_none", *BASELINE])
def test_every_forward_and_recompute_routes_its_own_micro_batch(run, case):
    recomputes = case != "none" and case != "vpp_none"
    layers = set()
    for rank in run:
        sample_routes = rank["sample_routes"]
        for layer, calls in rank[case]["routes"].items():
            layers.add(layer)
            expected = [expected_routes(sample_routes, m, layer) for m in range(MICRO_BATCHES)]
            with_grad = [chosen for grad, chosen in calls if grad]
            without_grad = [chosen for grad, chosen in calls if not grad]
            # micro-batches run forward in order, and (per chunk) backward in the same order
            assert len(with_grad) == MICRO_BATCHES and all(map(torch.equal, with_grad, expected)), (case, layer)
            if recomputes:  # the checkpointed forward, then the recompute in the backward pass
                assert len(without_grad) == MICRO_BATCHES and all(map(torch.equal, without_grad, expected))
            else:
                assert without_grad == []
    assert layers == set(range(LAYERS))
