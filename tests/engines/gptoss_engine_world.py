"""The body of the gpt-oss engine check: one gloo process. megarl's CPU engine (HF transformers)
generates from a tiny gpt-oss and returns its routes; the megatron actor (routing replay R3, its
CPU reference attention with sinks and windows) scores the rollout with the routes replayed and
without them. On a model whose routers have near ties the two differ (HF and megatron break the
ties differently); on a plain one the replayed actor trains one GRPO-style update (step-1 ppo_kl),
the reference replays too, and the trained actor's checkpoint and free-routing log-probs come back
for the export check."""
from __future__ import annotations

import torch

from engine_world import config, init_world, reset_layout
from megarl.data.batch import Batch
from megarl.engines.megatron.replay import REPLAY_KEYS
from megarl.trainer.experience import experience_batch, rollout_mismatch
from replay_world import TEMPERATURE, rollout


def without_routes(batch: Batch) -> Batch:
    return Batch({k: t for k, t in batch.tensors.items() if k not in REPLAY_KEYS}, batch.meta)


def gptoss_engine_world(rank: int, world_size: int, port: int, near_tie_dir: str, plain_dir: str,
                        checkpoint_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine, RefEngine

    init_world(rank, world_size, port)
    out = {}
    for name, model_dir in (("near_tie", near_tie_dir), ("plain", plain_dir)):
        prompts, samples = rollout(model_dir)
        batch = experience_batch(prompts, samples, "s0")
        mask = batch["response_mask"]
        cfg = config(model_dir, world_size, 1, 1, None, None, f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
                     "actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.actor.use_kl_loss=true")
        actor = ActorEngine(cfg)
        replayed = actor.compute_log_prob(batch, TEMPERATURE)["log_probs"]
        free = actor.compute_log_prob(without_routes(batch), TEMPERATURE)["log_probs"]
        out[name] = {"replayed": rollout_mismatch(replayed, batch["rollout_log_probs"], mask),
                     "free": rollout_mismatch(free, batch["rollout_log_probs"], mask)}
        if name == "plain":
            ref = RefEngine(cfg).compute_ref_log_prob(batch, TEMPERATURE)["ref_log_probs"]
            out[name]["ref_equal"] = torch.equal(ref, replayed)
            batch["ref_log_probs"], batch["old_log_probs"] = ref, replayed
            batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * mask
            out[name]["update"] = actor.update_policy(batch)
            actor.save_checkpoint(checkpoint_dir)
            out[name]["trained"] = actor.compute_log_prob(without_routes(batch), TEMPERATURE)["log_probs"]
            out[name]["batch"] = without_routes(batch)
        del actor
        reset_layout()
    return out
