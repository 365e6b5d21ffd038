"""Body of the old-log-probs-in-update check, run in gloo processes (2 ranks).

Per layout, two actors from the same checkpoint take the same two steps: one as the controller
did before (`compute_log_prob`, then `update_policy` with those old log-probs), one with
`update_policy_with_old_log_probs` on the batch without them. Ranks return what each path
produced: the old log-probs and entropies, the update metrics and the weights after each step, and
the torch.distributed collectives of each update with the old log-probs in it.
"""
from __future__ import annotations

import torch
from engine_world import ACTOR_LOSS, config, init_world, local_state, reset_layout, share_in_replica, training_batch

STEPS = 2
# name -> (TP, PP, extra overrides). 8 samples, 4 per mini-batch (ppo_mini_batch_size 8 prompts x
# n=1 / DP): "aligned" layouts score and train in micro-batches of the same rows (shuffle off,
# equal micro-batch sizes); "shuffled" trains two epochs of shuffled mini-batches in token-budget
# micro-batches, so its log-prob pass and its training forwards cut the rows differently.
LAYOUTS = {
    "dp2_aligned": (1, 1, ["actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]),
    "pp2_aligned": (1, 2, ["actor_rollout_ref.actor.ppo_mini_batch_size=4",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]),
    "tp2_shuffled": (2, 1, ["actor_rollout_ref.actor.ppo_mini_batch_size=4",
                            "actor_rollout_ref.actor.shuffle=true", "actor_rollout_ref.actor.ppo_epochs=2",
                            "actor_rollout_ref.actor.use_dynamic_bsz=true",
                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30",
                            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3", *ACTOR_LOSS]),
}


def count_forwards(actor) -> dict:
    """{"no_grad": 0, "grad": 0}, counting the forwards of the actor's first model chunk (one per
    micro-batch) by whether autograd records them."""
    counts = {"no_grad": 0, "grad": 0}

    def count(_module, _inputs):
        counts["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    actor.model_chunks[0].register_forward_pre_hook(count)
    return counts


def _separate(cfg, batch) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    out = {"dp_rank": actor.dp_rank, "scored": [], "metrics": [], "states": [], "forwards": count_forwards(actor)}
    for _ in range(STEPS):
        scored = actor.compute_log_prob(mine, 1.0, with_entropy=True)
        out["scored"].append(scored)
        mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
        out["metrics"].append(actor.update_policy(mine))
        out["states"].append(local_state(actor))
    return out


def _in_update(cfg, batch) -> dict:
    from megarl.engines.megatron.roles import ActorEngine
    from megarl.testing import CollectiveCounter

    actor = ActorEngine(cfg)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    keys = set(mine.keys())
    out = {"dp_rank": actor.dp_rank, "scored": [], "metrics": [], "states": [], "forwards": count_forwards(actor),
           "collectives": []}
    for _ in range(STEPS):
        with CollectiveCounter() as counter:
            metrics, scored = actor.update_policy_with_old_log_probs(mine)
        out["collectives"].append(counter.calls)
        out["scored"].append(scored)
        out["metrics"].append(metrics)
        out["states"].append(local_state(actor))
    out["batch_unchanged"] = set(mine.keys()) == keys
    return out


def old_log_probs_world(rank: int, world_size: int, port: int, models: dict) -> dict:
    init_world(rank, world_size, port)
    batch = training_batch()
    out = {}
    for name, (tp, pp, extra) in LAYOUTS.items():
        cfg = config(models["qwen2"], world_size, tp, pp, None, None, "actor_rollout_ref.rollout.n=1", *extra)
        out[name] = {"separate": _separate(cfg, batch)}
        reset_layout()
        out[name]["in_update"] = _in_update(cfg, batch)
        reset_layout()
    return out
