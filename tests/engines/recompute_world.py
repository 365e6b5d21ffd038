"""Body of the activation-recompute check, run in gloo processes (2 ranks, TP1 x PP2: two
layers per stage).

Per case the same actor takes the same step from the same checkpoint: old log-probs, then one PPO
update with a KL loss and an entropy bonus. Ranks return the old log-probs, the update's metrics,
the weights after it, the TransformerConfig's recompute settings, and how often each decoder layer
and each layer's core attention ran with and without autograd during the update (megatron's
checkpointed forward runs a recomputed part without autograd in the forward pass and again with
it in the backward pass). A critic with full recompute is checked the same way against one without.
An actor with verl's old-log-prob keys (a token budget) scores the batch too.
"""
from __future__ import annotations

import torch
from engine_world import ACTOR_LOSS, config, init_world, local_state, reset_layout, share_in_replica, training_batch

OVERRIDE = "+actor_rollout_ref.actor.megatron.override_transformer_config"
CRITIC_OVERRIDE = "+critic.megatron.override_transformer_config"
# name -> overrides. "none" is the baseline; "gradient_checkpointing" is megarl's switch (full, uniform, 1);
# "uniform_2": both layers of a stage as one chunk; "block_1": only the first layer of each stage
CASES = {
    "none": [],
    "gradient_checkpointing": ["actor_rollout_ref.model.enable_gradient_checkpointing=true"],
    "uniform_2": [f"{OVERRIDE}.recompute_granularity=full", f"{OVERRIDE}.recompute_method=uniform",
                  f"{OVERRIDE}.recompute_num_layers=2"],
    "block_1": [f"{OVERRIDE}.recompute_granularity=full", f"{OVERRIDE}.recompute_method=block",
                f"{OVERRIDE}.recompute_num_layers=1"],
    "selective": [f"{OVERRIDE}.recompute_granularity=selective", f"{OVERRIDE}.recompute_modules=[core_attn]"],
}
CRITIC_CASES = {
    "none": [],
    "full": [f"{CRITIC_OVERRIDE}.recompute_granularity=full", f"{CRITIC_OVERRIDE}.recompute_method=uniform",
             f"{CRITIC_OVERRIDE}.recompute_num_layers=1"],
}
RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")


def count_calls(engine) -> dict:
    """{("layer" | "core_attn", local layer index): {"grad": n, "no_grad": n}} of this rank's chunk,
    counted by forward pre-hooks from now on."""
    counts = {}

    def hook(key):
        counts[key] = {"grad": 0, "no_grad": 0}

        def count(_module, _inputs):
            counts[key]["grad" if torch.is_grad_enabled() else "no_grad"] += 1

        return count

    for i, layer in enumerate(engine.model_chunks[0].decoder.layers):
        layer.register_forward_pre_hook(hook(("layer", i)))
        layer.self_attention.core_attention.register_forward_pre_hook(hook(("core_attn", i)))
    return counts


def _settings(engine) -> dict:
    return {name: getattr(engine.transformer_config, name) for name in RECOMPUTE_FIELDS}


def _actor_step(cfg, batch) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    scored = actor.compute_log_prob(batch, 1.0, with_entropy=True)
    batch["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    counts = count_calls(actor)  # the update's forwards and recomputes only
    metrics = actor.update_policy(batch)
    return {"scored": scored, "metrics": metrics, "state": local_state(actor), "counts": counts,
            "micro_batches": len(actor.micro_batches(batch, max_samples=2, max_tokens=None)),
            "settings": _settings(actor)}


def _critic_step(cfg, batch) -> dict:
    from megarl.engines.megatron.roles import CriticEngine

    critic = CriticEngine(cfg)
    values = critic.compute_values(batch)
    batch["values"] = share_in_replica(values and values["values"])
    counts = count_calls(critic)
    metrics = critic.update_critic(batch)
    return {"values": values, "metrics": metrics, "state": local_state(critic), "counts": counts,
            "settings": _settings(critic)}


# verl's keys of the old-log-prob pass: a token budget, where the response count alone would make one micro-batch
OLD_LOG_PROB_BUDGET = 30
OLD_LOG_PROBS = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                 f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={OLD_LOG_PROB_BUDGET}"]


def _old_log_prob_pass(cfg, batch) -> dict:
    """The old log-probs, and how many forwards (micro-batches) the pass ran on this rank."""
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    forwards = []
    actor.model_chunks[0].register_forward_pre_hook(lambda _module, _inputs: forwards.append(1))
    return {"scored": actor.compute_log_prob(batch, 1.0, with_entropy=True), "forwards": len(forwards)}


def recompute_world(rank: int, world_size: int, port: int, models: dict) -> dict:
    init_world(rank, world_size, port)
    out = {"actor": {}, "critic": {}}
    for name, extra in CASES.items():
        cfg = config(models["qwen2"], world_size, 1, 2, None, None, "actor_rollout_ref.rollout.n=1", *ACTOR_LOSS,
                     *extra)
        out["actor"][name] = _actor_step(cfg, training_batch())
        reset_layout()
    cfg = config(models["qwen2"], world_size, 1, 2, None, None, "actor_rollout_ref.rollout.n=1", *OLD_LOG_PROBS)
    out["old_log_probs"] = _old_log_prob_pass(cfg, training_batch())
    reset_layout()
    for name, extra in CRITIC_CASES.items():
        cfg = config(models["qwen2"], world_size, 1, 2, None, None, "actor_rollout_ref.rollout.n=1", *extra)
        out["critic"][name] = _critic_step(cfg, training_batch())
        reset_layout()
    return out
