"""Body of the routing-replay-with-recompute check, run in 2 gloo processes (TP1 x PP2, a
tiny 4-layer Qwen3-MoE: two layers per stage, or one per chunk with VPP=2).

Per case the same actor takes the same step from the same checkpoint with routing replay (R3) on
hand-made routes: old log-probs, then one PPO update over 4 micro-batches of 2 samples. All
samples have the same length, so every micro-batch has the same shape and a router given another
micro-batch's routes runs (on wrong routes) instead of failing on a shape. Ranks return the
update's metrics, the weights after it, and every routing decision of each local MoE router
during the update, seen by a forward hook on megatron's router (its routing map [tokens, E]), with
whether autograd was on (a checkpointed forward runs a recomputed part without autograd in the
forward pass and again with it in the backward pass).
"""
from __future__ import annotations

import torch
from engine_world import config, init_world, local_state, reset_layout, share_in_replica

from megarl.data.batch import Batch
from megarl.trainer.experience import routed_experts_grids

OVERRIDE = "+actor_rollout_ref.actor.megatron.override_transformer_config"
# name -> (VPP, overrides); "none" and "vpp_none" are the baselines without recompute
CASES = {
    "none": (None, []),
    "full": (None, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"]),  # full, uniform, 1 layer
    "moe": (None, [f"{OVERRIDE}.recompute_granularity=selective", f"{OVERRIDE}.recompute_modules=[moe]"]),
    "vpp_none": (2, []),
    "vpp_full": (2, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"]),
}
LAYERS, EXPERTS, TOPK = 4, 8, 2
SAMPLES, PROMPT, RESPONSE = 8, 3, 4  # tokens per sample; micro-batches of 2 samples (engine_world.config)


def replay_batch() -> tuple[Batch, list[torch.Tensor]]:
    """The batch (routes, advantages, reference log-probs) and each sample's routes [T - 1, L, K]:
    K distinct random experts per token and layer (the last token has none recorded)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 47, (PROMPT,), generator=g).tolist() for _ in range(SAMPLES)]
    responses = [torch.randint(4, 47, (RESPONSE,), generator=g).tolist() for _ in range(SAMPLES)]
    batch = Batch.from_token_lists(prompts, responses)
    tokens = PROMPT + RESPONSE - 1
    routes = [torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens * LAYERS)])
              .reshape(tokens, LAYERS, TOPK).int() for _ in range(SAMPLES)]
    batch["prompt_routed_experts"], batch["routed_experts"] = routed_experts_grids(
        routes, batch["prompt_mask"], batch["response_mask"])
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(SAMPLES, 1, generator=g) * mask
    batch["ref_log_probs"] = (-3.8 + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    return batch, routes


def record_routes(engine) -> dict:
    """{global layer index: [(autograd on, [tokens, K] the experts chosen per token, ascending)]}
    of this rank's routers, appended by a forward hook on each from now on."""
    from megarl.engines.megatron.replay import moe_routers

    seen = {}

    def hook(layer):
        def record(_module, _inputs, outputs):
            routing_map = outputs[1]  # [tokens, E] bool
            chosen = routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1)
            seen[layer].append((torch.is_grad_enabled(), chosen.clone()))
        seen[layer] = []
        return record

    for layer, router in moe_routers(engine.model_chunks):
        router.register_forward_hook(hook(layer))
    return seen


def _actor_step(cfg, batch) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    scored = actor.compute_log_prob(batch, 1.0)
    batch["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    routes = record_routes(actor)  # the update's forwards and recomputes only
    metrics = actor.update_policy(batch)
    del batch.tensors["old_log_probs"]
    return {"metrics": metrics, "state": local_state(actor), "routes": routes}


def replay_recompute_world(rank: int, world_size: int, port: int, model_dir: str) -> dict:
    init_world(rank, world_size, port)
    batch, routes = replay_batch()
    out = {"sample_routes": routes}
    for name, (vpp, extra) in CASES.items():
        cfg = config(model_dir, world_size, 1, 2, vpp, None, "actor_rollout_ref.rollout.n=1",
                     "actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.kl_loss_coef=0.1", *extra)
        out[name] = _actor_step(cfg, batch)
        reset_layout()
    return out
