"""The body of the MoE engine check: 2 gloo processes, an actor and a reference engine of
a tiny Qwen3-MoE at TP1 / EP2 (each rank holds 4 of the 8 experts of every layer, DP 2) and its
weight-sync resharder; the actor's checkpoint after two updates and its log-probs on those weights;
then an actor at TP2 / EP1 (each expert split over the TP ranks), started from the bridge's
`torch_dist` conversion of the HF checkpoint, and its resharder, then an actor at PP2 (log-probs
and expert counts only)."""
from __future__ import annotations

import torch

from engine_world import config, init_world, ragged_batch, reset_layout, share_in_replica
from megarl.data.batch import Batch
from megarl.sync import ParallelGroups, Resharder

TEMPERATURE = 0.7
EP2 = [f"actor_rollout_ref.{role}.megatron.expert_model_parallel_size=2" for role in ("actor", "ref")]


def moe_world(rank: int, world_size: int, port: int, model_dir: str, mcore_dir: str, checkpoint_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine, RefEngine

    init_world(rank, world_size, port)
    batch = ragged_batch(8)
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    cfg = config(model_dir, world_size, 1, 1, None, None, *EP2, f"actor_rollout_ref.rollout.temperature={TEMPERATURE}")
    actor = ActorEngine(cfg)
    out = {"ep2_synced": resharded(actor)}  # the loaded checkpoint, gathered across the EP ranks
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, TEMPERATURE, with_entropy=True)
    ref = RefEngine(cfg).compute_ref_log_prob(mine, TEMPERATURE)
    mine["old_log_probs"] = share_in_replica(scored["log_probs"])
    updates = [actor.update_policy(mine) for _ in range(2)]
    out.update({"dp_rank": actor.dp_rank, "scored": scored, "updates": updates,
                "ref_equal": torch.equal(ref["ref_log_probs"], scored["log_probs"])})
    actor.save_checkpoint(checkpoint_dir)  # what a run's checkpoint holds for the actor (+ optimizer)
    out["trained"] = actor.compute_log_prob(mine, TEMPERATURE)  # the same weights
    del actor
    reset_layout()

    # TP1 / EP1 (every rank holds all experts, DP 2): the same two updates, for comparison; the
    # first makes its own old log-probs (and expert counts) from the batch without them
    actor = ActorEngine(config(model_dir, world_size, 1, 1, None, None, f"actor_rollout_ref.rollout.temperature={TEMPERATURE}"))
    without_old = Batch({k: t for k, t in mine.tensors.items() if k != "old_log_probs"}, mine.meta)
    first, out["ep1_in_update"] = actor.update_policy_with_old_log_probs(without_old)
    out["ep1_updates"] = [first, actor.update_policy(mine)]
    del actor
    reset_layout()

    # TP2 / EP1 (experts split over TP), from the converted torch_dist checkpoint: log-probs, and
    # the resharder's HF tensors
    actor = ActorEngine(config(mcore_dir, world_size, 2, 1, None, None))
    out["tp2_scored"] = actor.compute_log_prob(batch, TEMPERATURE, with_entropy=True)
    out["tp2_synced"] = resharded(actor)
    del actor
    reset_layout()

    # PP2 (one MoE layer per stage): the expert counts of both stages reach the output rank
    out["pp2_scored"] = ActorEngine(config(model_dir, world_size, 1, 2, None, None)).compute_log_prob(batch, TEMPERATURE)
    return out


def resharded(actor) -> dict:
    """The HF tensors the actor's weight-sync resharder emits on this rank (on an emitter; None elsewhere)."""
    groups = ParallelGroups.from_parallel_state()
    synced = {}
    for bucket in Resharder(actor.model_chunks, actor.weight_map, groups, 1 << 16).buckets():
        synced.update({name: tensor.clone() for name, tensor in bucket.named_tensors()})
    return synced if groups.is_emitter else None
