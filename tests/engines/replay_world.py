"""The body of the routing-replay check: one gloo process generates with megarl's CPU engine
(HF transformers) on a tiny Qwen3-MoE, carries the routes through SGLang's wire format, the
client and the experience batch, and scores the rollout with the megatron actor with routing
replay on and off."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from engine_world import config, init_world, reset_layout
from megarl.rollout.client import Sample
from megarl.rollout.cpu.engine import CPUEngine
from megarl.rollout.cpu.server import _output
from megarl.rollout.protocol import SamplingParams
from megarl.trainer.experience import experience_batch, rollout_mismatch

TEMPERATURE = 0.8
PROMPTS = [[5, 9, 12, 7], [20, 3], [8, 8, 30, 14, 2, 11], [40, 17, 6]]


def rollout(model_dir: str, n: int = 2, max_new_tokens: int = 8):
    """(prompts, samples) as the trainer gets them: each sample decoded from the CPU server's JSON."""
    engine = CPUEngine(model_dir, return_routed_experts=True, random_seed=5)
    done, seqs = threading.Semaphore(0), []
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, n=n, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.submit(prompt, sampling, True, f"p{i}", lambda s: (seqs.append(s), done.release()),
                      routed_experts_start_len=0)
    for _ in range(n * len(PROMPTS)):
        assert done.acquire(timeout=120)
    engine.shutdown()
    c = engine.config
    samples = []
    for i, prompt in enumerate(PROMPTS):
        mine = sorted((s for s in seqs if s.rid == f"p{i}"), key=lambda s: s.index)
        samples.append([Sample.from_sglang(_output(engine, s, n), (len(prompt) + len(s.output_ids) - 1,
                                           c.num_hidden_layers, c.num_experts_per_tok), c.num_experts)
                        for s in mine])  # routes narrowed to uint8, as the client does
    prompts = [SimpleNamespace(index=i, input_ids=p, row=SimpleNamespace(data_source="t", ground_truth="", extra_info={}))
               for i, p in enumerate(PROMPTS)]
    return prompts, samples


def replay_world(rank: int, world_size: int, port: int, model_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine, RefEngine

    init_world(rank, world_size, port)
    prompts, samples = rollout(model_dir)
    batch = experience_batch(prompts, samples, "s0")
    mask = batch["response_mask"]
    out = {"routes": [[s.routed_experts for s in per] for per in samples], "batch": batch}
    for mode in ("R3", "disabled"):
        cfg = config(model_dir, world_size, 1, 1, None, None, f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
                     f"actor_rollout_ref.actor.router_replay.mode={mode}",
                     "actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=0.01",
                     "actor_rollout_ref.actor.megatron.moe_z_loss_coeff=0.001",
                     "actor_rollout_ref.actor.use_kl_loss=true")
        actor = ActorEngine(cfg)
        tc = actor.transformer_config
        out[f"{mode}_router_losses"] = (tc.moe_router_load_balancing_type, tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff)
        scored = actor.compute_log_prob(batch, TEMPERATURE)
        log_probs = scored["log_probs"]
        out[mode] = {"log_probs": log_probs, "expert_tokens": scored["expert_tokens"],
                     **rollout_mismatch(log_probs, batch["rollout_log_probs"], mask)}
        if mode == "R3":
            batch["ref_log_probs"] = RefEngine(cfg).compute_ref_log_prob(batch, TEMPERATURE)["ref_log_probs"]
            out[mode]["ref_log_probs"] = batch["ref_log_probs"]
            batch["old_log_probs"] = log_probs
            batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * mask
            out[mode]["update"] = actor.update_policy(batch)
            for key in ("ref_log_probs", "old_log_probs", "advantages"):
                del batch.tensors[key]
        del actor
        reset_layout()
    return out
