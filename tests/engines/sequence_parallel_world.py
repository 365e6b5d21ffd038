"""Body of the sequence-parallelism check, run in gloo processes (2 ranks, TP2, DP1).

The same actor and the same critic take the same step from the same HF checkpoint at TP2 without
and with `sequence_parallel`: the actor scores the batch (log-probs and entropies, temperature
0.7), takes one PPO update with a KL loss and an entropy bonus, and scores the batch again; the
critic computes values, takes one value update, and computes them again. Ranks return those, the
update metrics, the weights after the update, and what shows that sequence parallelism ran: the
TransformerConfig's flag, the rows of the sequence the final norm saw, the norms' parameter tags.

Then a tiny Qwen3-MoE actor, which megatron-core trains at TP > 1 only with sequence parallelism:
the same steps at TP2 with it and at TP1 (DP2), with its own routing and with routing replay.
"""
from __future__ import annotations

import torch
from engine_world import ACTOR_LOSS, config, init_world, local_state, reset_layout, share_in_replica, training_batch

TEMPERATURE = 0.7
CASES = {"tp2": [], "tp2_sp": ["actor_rollout_ref.actor.megatron.sequence_parallel=true",
                               "critic.megatron.sequence_parallel=true"]}


def _seen_rows(engine) -> list:
    """The sequence lengths the final norm of the last chunk sees per forward, from now on."""
    rows = []
    engine.model_chunks[-1].decoder.final_layernorm.register_forward_hook(
        lambda _module, inputs, _output: rows.append(inputs[0].shape[0]))
    return rows


def _built(engine, rows) -> dict:
    norms = [p for name, p in engine.model_chunks[0].named_parameters() if "layernorm" in name]
    mbs = engine.micro_batches(training_batch(), max_samples=2, max_tokens=None)
    return {"sequence_parallel": engine.transformer_config.sequence_parallel,
            "norms_tagged": bool(norms) and all(getattr(p, "sequence_parallel", False) for p in norms),
            "seen_rows": list(rows), "padded_lengths": [mb.input_ids.shape[1] for mb in mbs],
            "lengths": [int(training_batch().token_lengths()[mb.rows].max()) for mb in mbs]}


def _actor(cfg) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    rows = _seen_rows(actor)
    batch = training_batch()
    scored = actor.compute_log_prob(batch, TEMPERATURE, with_entropy=True)
    batch["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    metrics = actor.update_policy(batch)
    after = actor.compute_log_prob(batch, TEMPERATURE)
    return {"scored": scored, "metrics": metrics, "after": after, "state": local_state(actor),
            "built": _built(actor, rows)}


def _critic(cfg) -> dict:
    from megarl.engines.megatron.roles import CriticEngine

    critic = CriticEngine(cfg)
    rows = _seen_rows(critic)
    batch = training_batch()
    values = critic.compute_values(batch)
    batch["values"] = share_in_replica(values and values["values"])
    metrics = critic.update_critic(batch)
    return {"values": values, "metrics": metrics, "after": critic.compute_values(batch),
            "state": local_state(critic), "built": _built(critic, rows)}


def sequence_parallel_world(rank: int, world_size: int, port: int, models: dict, moe_dir: str) -> dict:
    """The dense cases (CASES) on `models["qwen2"]`, then the MoE ones (`moe_cases`) on `moe_dir`."""
    init_world(rank, world_size, port)
    out = {}
    for name, extra in CASES.items():
        cfg = config(models["qwen2"], world_size, 2, 1, None, None, "actor_rollout_ref.rollout.n=1",
                     f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", *ACTOR_LOSS, *extra)
        out[name] = {"actor": _actor(cfg)}
        reset_layout()
        out[name]["critic"] = _critic(cfg)
        reset_layout()
    out["moe"] = moe_cases(world_size, moe_dir)
    return out


# ------------------------------------------------------------------------------------------ MoE
MOE_CASES = {  # name -> (TP, extra overrides): megatron trains MoE layers at TP > 1 only with sequence parallelism
    "tp1": (1, []),
    "tp2_sp": (2, ["actor_rollout_ref.actor.megatron.sequence_parallel=true"]),
}
REPLAY = ["actor_rollout_ref.actor.router_replay.mode=R3"]


def forced_routes(batch, num_layers: int, num_experts: int, top_k: int, seed: int = 4) -> None:
    """Give `batch` routes to replay ([B, P or R, L, K]: K distinct experts per token and layer, drawn at random)."""
    g = torch.Generator().manual_seed(seed)
    for key, width in (("prompt_routed_experts", batch["prompt_ids"].shape[1]),
                       ("routed_experts", batch["response_ids"].shape[1])):
        draw = torch.rand(len(batch), width, num_layers, num_experts, generator=g)
        batch[key] = draw.argsort(-1)[..., :top_k].to(torch.uint8)


def _moe_actor(cfg, batch, sequence_layout=None) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg, sequence_layout)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, TEMPERATURE, with_entropy=True)
    mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    metrics = actor.update_policy(mine)
    return {"dp_rank": actor.dp_rank, "scored": scored, "metrics": metrics,
            "after": actor.compute_log_prob(mine, TEMPERATURE)}


def moe_cases(world_size: int, model_dir: str, cases: dict = MOE_CASES) -> dict:
    """A tiny Qwen3-MoE actor in each layout of `cases` (name -> (TP, overrides[, sequence layout]);
    MOE_CASES: TP1 at DP2, and TP2 with sequence parallelism at DP1): scores with expert counts, one PPO update, scores
    after it; then the same with routing replay of forced routes (`forced_routes`, seed 4). Keys:
    the cases' names, "_replay" added for the replayed."""
    from megarl.bridge import arch_from_hf_config, load_hf_config

    arch = arch_from_hf_config(load_hf_config(model_dir))
    batch = training_batch()
    replayed = training_batch()
    forced_routes(replayed, arch.num_layers, arch.moe.num_experts, arch.moe.topk)
    out = {}
    for name, (tp, extra, *layout) in cases.items():
        for replay, data in ((False, batch), (True, replayed)):
            cfg = config(model_dir, world_size, tp, 1, None, None, "actor_rollout_ref.rollout.n=1",
                         f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", *ACTOR_LOSS, *extra,
                         *(REPLAY if replay else []))
            out[name + ("_replay" if replay else "")] = _moe_actor(cfg, data, *layout)
            reset_layout()
    return out
