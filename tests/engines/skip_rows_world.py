"""Body of the zero-advantage-row check, run in gloo processes (2 ranks: DP 2, or PP 2 x VPP 2).

Per case, actors from the same checkpoint take the same update on the same batch, one with
`actor_rollout_ref.actor.skip_zero_advantage_rows=false` (every row: the oracle) and one with
auto, which leaves out the rows whose advantages are all 0. Ranks return the update's metrics, the
weights before and after, the training forwards per rank and the collectives of the update; for
the case "mixed" also the old log-probs made inside the update (`update_policy_with_old_log_probs`).
"""
from __future__ import annotations

import torch
from engine_world import config, init_world, local_state, ragged_batch, reset_layout, share_in_replica
from old_log_probs_world import count_forwards

# 16 samples in mini-batches of 8 (ppo_mini_batch_size 4 prompts x n=2), micro-batches of 2 rows. At DP 2 rank 0
# holds rows 0-7, rank 1 rows 8-15, 4 of each mini-batch. Each row's advantage (0: the update may leave it out),
# the loss aggregation and the layout (TP, PP, VPP).
MIXED = [0.5, 0.0, 0.0, -1.0, 0.0, 0.4, 0.0, 0.7, 0.0, 1.0, 0.0, 0.0, -0.3, 0.0, 0.2, 0.0]
CASES = {
    # every mini-batch has rows to learn from on both ranks (rows trained: 3 of 8, then 4 of 8)
    "mixed": (MIXED, "token-mean", (1, 1, None)),
    # rank 1 has nothing to learn; the second mini-batch has nothing on either rank (a zero gradient
    # on both): a rank without one runs one of its rows of advantage 0 (4 of 8, then 2 of 8)
    "idle_rank": ([0.5, 0.0, -1.0, 0.3, 0.0, 0.0, 0.0, 0.0] + [0.0] * 8, "seq-mean-token-sum-norm", (1, 1, None)),
    # DP 1 over two pipeline stages, interleaved (VPP 2): both stages run the same micro-batches, at least PP of
    # them, so a mini-batch keeps 2 rows (rows 0-7: 4 of 8; rows 8-15: row 14 and row 8 of advantage 0)
    "pp2_interleaved": ([0.5, 0.0, 0.0, -1.0, 0.0, 0.4, 0.0, 0.7] + [0.0] * 6 + [0.2, 0.0], "seq-mean-token-mean",
                        (1, 2, 2)),
}
SETTINGS = ("false", "auto")
# plain gradient steps, unclipped: the step is the gradient (Adam's and the clip's normalisations would
# hide a gradient of the wrong scale)
SGD = ["actor_rollout_ref.actor.optim.optimizer=sgd", "actor_rollout_ref.actor.optim.lr=1.0",
       "actor_rollout_ref.actor.optim.clip_grad=1e6"]


def skip_batch(advantages: list[float]):
    """The 16-row ragged batch with per-row `advantages` and old log-probs made later."""
    batch = ragged_batch(16, seed=3)
    batch["advantages"] = torch.tensor(advantages)[:, None] * batch["response_mask"]
    return batch


def _actor(model_dir, case: str, setting: str):
    from megarl.engines.megatron.roles import ActorEngine

    _, agg, (tp, pp, vpp) = CASES[case]
    return ActorEngine(config(
        model_dir, 2, tp, pp, vpp, None, "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.loss_agg_mode={agg}", *SGD,
        f"actor_rollout_ref.actor.skip_zero_advantage_rows={setting}"))


def _update(model_dir, case: str, setting: str) -> dict:
    from megarl.testing import CollectiveCounter

    actor = _actor(model_dir, case, setting)
    mine = skip_batch(CASES[case][0]).chunk(actor.dp_size)[actor.dp_rank]
    scored = share_in_replica((actor.compute_log_prob(mine, 1.0) or {}).get("log_probs"))
    noise = 0.05 * torch.randn(scored.shape, generator=torch.Generator().manual_seed(actor.dp_rank))
    mine["old_log_probs"] = (scored + noise) * mine["response_mask"]  # ratios off 1: some tokens clip
    out = {"dp_rank": actor.dp_rank, "before": local_state(actor), "forwards": count_forwards(actor),
           "tokens": mine["response_mask"].sum(1)}
    with CollectiveCounter() as counter:
        out["metrics"] = actor.update_policy(mine)
    out["collectives"] = counter.calls
    out["after"] = local_state(actor)
    return out


def _in_update(model_dir, setting: str) -> dict:
    actor = _actor(model_dir, "mixed", setting)
    mine = skip_batch(CASES["mixed"][0]).chunk(actor.dp_size)[actor.dp_rank]
    before, forwards = local_state(actor), count_forwards(actor)
    metrics, scored = actor.update_policy_with_old_log_probs(mine)
    return {"metrics": metrics, "scored": scored, "before": before, "after": local_state(actor), "forwards": forwards}


def skip_rows_world(rank: int, world_size: int, port: int, models: dict) -> dict:
    init_world(rank, world_size, port)
    out = {}
    for case in CASES:  # old log-probs given with the batch: `true` leaves the rows out, `auto` does not
        for setting in ("false", "true"):
            out[case, setting] = _update(models["qwen2"], case, setting)
            reset_layout()
    out["separate_pass", "auto"] = _update(models["qwen2"], "mixed", "auto")
    reset_layout()
    for setting in SETTINGS:
        out["in_update", setting] = _in_update(models["qwen2"], setting)
        reset_layout()
    return out
