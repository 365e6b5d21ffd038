"""The body of the MoE engine check: 2 spawned gloo processes, an actor and a reference engine of
a tiny Qwen3-MoE at TP1 / EP2 (each rank holds 4 of the 8 experts of every layer, DP 2)."""
from __future__ import annotations

import torch

from engine_world import config, init_world, ragged_batch, share_in_replica

TEMPERATURE = 0.7
EP2 = [f"actor_rollout_ref.{role}.megatron.expert_model_parallel_size=2" for role in ("actor", "ref")]


def moe_world(rank: int, world_size: int, port: int, model_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine, RefEngine

    init_world(rank, world_size, port)
    batch = ragged_batch(8)
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    cfg = config(model_dir, world_size, 1, 1, None, None, *EP2, f"actor_rollout_ref.rollout.temperature={TEMPERATURE}")
    actor = ActorEngine(cfg)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, TEMPERATURE, with_entropy=True)
    ref = RefEngine(cfg).compute_ref_log_prob(mine, TEMPERATURE)
    mine["old_log_probs"] = share_in_replica(scored["log_probs"])
    updates = [actor.update_policy(mine) for _ in range(2)]
    return {"dp_rank": actor.dp_rank, "scored": scored, "ref_equal": torch.equal(ref["ref_log_probs"], scored["log_probs"]),
            "updates": updates}
