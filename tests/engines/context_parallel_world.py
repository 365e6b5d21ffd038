"""Body of the context-parallelism check, run in gloo processes (2 ranks).

The same actor and critic at CP1 (DP2) and at CP2 (DP1, megarl's CPU reference CP attention): the
actor scores the batch (log-probs and entropies), takes one PPO update with a KL loss and an
entropy bonus, scores again, and saves a checkpoint at CP2, which an actor at CP1 loads; the critic
computes values, takes one update and computes them again. The actor's weight-sync resharder emits
after the update. A reward model scores at CP2; a tiny
Qwen3-MoE actor takes the same steps at CP1 and CP2, with its own routing and with routing replay
(sequence_parallel_world.moe_cases).
"""
from __future__ import annotations

from engine_world import (ACTOR_LOSS, config, init_world, local_state, ragged_batch, reset_layout, share_in_replica,
                          training_batch)
from moe_engine_world import resharded
from sequence_parallel_world import moe_cases

TEMPERATURE = 0.7


def _cp(cp: int) -> list[str]:
    return [f"{s}.megatron.context_parallel_size={cp}" for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref",
                                                                  "critic", "reward_model")]


def _actor(cfg, checkpoint_dir=None, sequence_layout=None) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg, sequence_layout)
    mine = training_batch().chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, TEMPERATURE, with_entropy=True)
    mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    metrics = actor.update_policy(mine)
    after = actor.compute_log_prob(mine, TEMPERATURE)
    if checkpoint_dir is not None:
        actor.save_checkpoint(checkpoint_dir)
    return {"dp_rank": actor.dp_rank, "output_rank": actor.is_output_rank, "scored": scored, "metrics": metrics,
            "after": after, "state": local_state(actor), "synced": resharded(actor),
            "core_attention": type(actor.model_chunks[0].decoder.layers[0].self_attention.core_attention).__name__,
            "sequence_layout": actor.sequence_layout,
            "input_lengths": [mb.input_ids.shape[1]
                              for mb in actor.micro_batches(mine, max_samples=2, max_tokens=None)],
            "budget_groups": [mb.rows.tolist() for mb in actor.micro_batches(mine, max_samples=None, max_tokens=30)]}


def _critic(cfg, sequence_layout=None) -> dict:
    from megarl.engines.megatron.roles import CriticEngine

    critic = CriticEngine(cfg, sequence_layout)
    mine = training_batch().chunk(critic.dp_size)[critic.dp_rank]
    values = critic.compute_values(mine)
    mine["values"] = share_in_replica(values and values["values"])
    metrics = critic.update_critic(mine)
    return {"dp_rank": critic.dp_rank, "values": values, "metrics": metrics, "after": critic.compute_values(mine)}


def context_parallel_world(rank: int, world_size: int, port: int, models: dict, rm_dir: str, moe_dir: str,
                           checkpoint_dir: str) -> dict:
    init_world(rank, world_size, port)
    out = {}
    for cp in (1, 2):
        cfg = config(models["qwen2"], world_size, 1, 1, None, None, "actor_rollout_ref.rollout.n=1",
                     f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", *ACTOR_LOSS, *_cp(cp))
        out[f"cp{cp}"] = {"actor": _actor(cfg, checkpoint_dir if cp == 2 else None)}
        reset_layout()
        out[f"cp{cp}"]["critic"] = _critic(cfg)
        reset_layout()
    # the CP2 checkpoint at CP1
    from megarl.engines.megatron.reward_model import RewardModelEngine
    from megarl.engines.megatron.roles import ActorEngine

    cfg = config(models["qwen2"], world_size, 1, 1, None, None, *_cp(1))
    resumed = ActorEngine(cfg)
    resumed.load_checkpoint(checkpoint_dir)
    out["resumed"] = {"state": local_state(resumed), "updates": resumed.updates}
    reset_layout()
    rm = RewardModelEngine(config(rm_dir, world_size, 1, 1, None, None, "reward_model.enable=true",
                                  f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=3",
                                  *_cp(2)))
    out["rm_scores"] = rm.compute_rm_scores(ragged_batch(10, seed=3))
    reset_layout()
    out["moe"] = moe_cases(world_size, moe_dir, {"cp1": (1, []), "cp2": (1, _cp(2)),
                                                 "cp2_packed": (1, _cp(2), "packed")})
    reset_layout()
    # packed (THD) sequences: megarl's CPU reference attention at CP1 and CP2
    for cp in (1, 2):
        cfg = config(models["qwen2"], world_size, 1, 1, None, None, "actor_rollout_ref.rollout.n=1",
                     f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", *ACTOR_LOSS, *_cp(cp))
        out[f"cp{cp}_packed"] = {"actor": _actor(cfg, sequence_layout="packed")}
        reset_layout()
    out["cp2_packed"]["critic"] = _critic(cfg, "packed")
    reset_layout()
    rm = RewardModelEngine(config(rm_dir, world_size, 1, 1, None, None, "reward_model.enable=true",
                                  f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=3",
                                  *_cp(2)), sequence_layout="packed")
    out["rm_scores_packed"] = rm.compute_rm_scores(ragged_batch(10, seed=3))
    reset_layout()
    return out


SP = [f"{s}.megatron.sequence_parallel=true" for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")]


# name, TP, CP, overrides, sequence layout (None: the engine's default, padded on CPU)
ODD_CASES = (("odd_tp2_sp", 2, 1, SP, None), ("odd_cp2", 1, 2, [], None), ("odd_cp2_packed", 1, 2, [], "packed"),
             ("odd_tp2_cp2_sp", 2, 2, SP, None), ("odd_tp2_cp2_packed", 2, 2, [], "packed"),
             ("odd_tp2_cp2_sp_packed", 2, 2, SP, "packed"))


def tp2_cp2_world(rank: int, world_size: int, port: int, models: dict, odd_model: str) -> dict:
    """4 ranks: the actor at TP1 (DP4), then at TP2 x CP2 (DP1) padded with sequence parallelism and
    packed without and with it: scores, one PPO update, scores after it. Then an odd-shaped GQA model
    (`odd_model`) scores in each layout of ODD_CASES."""
    from megarl.engines.megatron.roles import ActorEngine

    init_world(rank, world_size, port)
    out = {}
    for name, tp, cp, extra, layout in ODD_CASES:
        cfg = config(odd_model, world_size, tp, 1, None, None, "actor_rollout_ref.rollout.n=1", *_cp(cp), *extra)
        actor = ActorEngine(cfg, layout)
        out[name] = {"dp_rank": actor.dp_rank, "sequence_layout": actor.sequence_layout,
                     "scored": actor.compute_log_prob(training_batch().chunk(actor.dp_size)[actor.dp_rank],
                                                      TEMPERATURE, with_entropy=True)}
        reset_layout()
    for name, tp, extra, layout in (("tp1", 1, _cp(1), None), ("tp2_cp2_sp", 2, _cp(2) + SP, None),
                                    ("tp2_cp2_packed", 2, _cp(2), "packed"),
                                    ("tp2_cp2_sp_packed", 2, _cp(2) + SP, "packed")):
        cfg = config(models["qwen2"], world_size, tp, 1, None, None, "actor_rollout_ref.rollout.n=1",
                     f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", *ACTOR_LOSS, *extra)
        actor = _actor(cfg, sequence_layout=layout)
        out[name] = {k: actor[k] for k in ("dp_rank", "output_rank", "scored", "metrics", "after", "input_lengths",
                                           "sequence_layout")}
        reset_layout()
    return out
