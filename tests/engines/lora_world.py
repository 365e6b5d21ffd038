"""Bodies of the LoRA engine checks, run in one spawned 2-rank gloo world (see engine_world.py).

The same PPO updates of the LoRA actor at TP1 (DP2), TP2 (DP1) and PP2 (DP1), on one batch, each
with a checkpoint after update 2 and an engine resumed from it; at TP1 also the base actor's
log-probs and the merged HF export; then two value updates of a LoRA critic at TP2. Ranks return what the test
compares with HF / PEFT.
"""
from __future__ import annotations

import torch
from engine_world import config, init_world, reset_layout, share_in_replica, training_batch

LORA = ("actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=8",
        "actor_rollout_ref.actor.optim.lr=1e-2")  # a large LR: adapters move visibly in two updates
UPDATES, SAVE_AFTER = 3, 2
CHECKPOINT = f"global_step_{SAVE_AFTER}"  # a megarl experiment checkpoint's actor directory


def lora_config(model_dir, world: int, tp: int, pp: int, *extra: str):
    return config(model_dir, world, tp, pp, None, None, *LORA, *extra)


def _params(actor) -> dict[str, torch.Tensor]:
    """{local name: copy} of every parameter of this rank (chunk index prefixed)."""
    return {f"{v}.{n}": p.detach().clone() for v, c in enumerate(actor.model_chunks) for n, p in c.named_parameters()}


def full_adapters(actor) -> dict[str, torch.Tensor]:
    """{global adapter name: full tensor} of the whole model, on every rank (TP shards gathered,
    PP stages collected), for comparing layouts."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.bridge.lora import AdapterName
    from megarl.bridge.sharding import unshard_tp

    tp_group = ps.get_tensor_model_parallel_group()
    mine = {}
    for adapter, _ in actor.lora_adapters:
        for local, param in adapter.named_parameters():
            target, factor = local.rsplit("_", 1)
            name = AdapterName(_layer_of(actor, adapter), target, factor)
            shards = [torch.empty_like(param) for _ in range(ps.get_tensor_model_parallel_world_size())]
            dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
            mine[name.mcore] = unshard_tp(name.tp, shards)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _adapter_sync_gather(actor):
    """What adapter-only sync would write (megarl.sync.adapter_sync), on pipeline rank 0."""
    from megatron.core import parallel_state as ps

    from megarl.sync.adapter_sync import gather_full_adapters

    return gather_full_adapters(actor.lora_adapters, ps.get_tensor_model_parallel_group(),
                                ps.get_pipeline_model_parallel_group())


def _layer_of(actor, adapter) -> int:
    for chunk in actor.model_chunks:
        for layer in chunk.decoder.layers:
            if any(m is adapter for m in layer.modules()):
                return layer.layer_number - 1
    raise LookupError("adapter not in the model")


def _train(cfg, batch, *, base_cfg=None, export_dir=None, checkpoint_dir=None) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    out = {}
    if base_cfg is not None:  # the base model (no LoRA) at the same layout
        base = ActorEngine(base_cfg)
        scored = base.compute_log_prob(batch.chunk(base.dp_size)[base.dp_rank], 1.0)
        out["base_log_probs"] = scored and scored["log_probs"]
        del base
    actor = ActorEngine(cfg)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, 1.0)
    out["dp_rank"] = actor.dp_rank
    out["init_log_probs"] = scored and scored["log_probs"]
    mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    before = _params(actor)
    out["trainable"] = sorted(n for c in actor.model_chunks for n, p in c.named_parameters() if p.requires_grad)
    out["frozen_count"] = sum(not p.requires_grad for c in actor.model_chunks for p in c.parameters())
    out["grad_buffer_numel"] = sum(b.grad_data.numel() for c in actor._ddp_chunks for b in c.buffers)
    out["adapter_numel"] = sum(p.numel() for a, _ in actor.lora_adapters for p in a.parameters())
    out["metrics"] = []
    for update in range(1, UPDATES + 1):
        out["metrics"].append(actor.update_policy(mine))
        if update == SAVE_AFTER and checkpoint_dir is not None:
            actor.save_checkpoint(checkpoint_dir)
    after = _params(actor)
    out["changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
    scored = actor.compute_log_prob(mine, 1.0)
    out["final_log_probs"] = scored and scored["log_probs"]
    out["adapters"] = full_adapters(actor)
    out["sync_adapters"] = _adapter_sync_gather(actor)
    if export_dir is not None:
        actor.export_hf(export_dir)  # through the resharder, the weights merged
        out["restored_after_export"] = all(torch.equal(after[n], p) for n, p in _params(actor).items())
    return out


def _resume(cfg, batch, checkpoint_dir, old_log_probs) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    actor.load_checkpoint(checkpoint_dir)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    loaded = actor.compute_log_prob(mine, 1.0)
    mine["old_log_probs"] = share_in_replica(old_log_probs)
    metrics = [actor.update_policy(mine) for _ in range(UPDATES - SAVE_AFTER)]
    return {"updates": actor.updates, "metrics": metrics, "adapters": full_adapters(actor),
            "loaded_log_probs": loaded and loaded["log_probs"], "dp_rank": actor.dp_rank}


def _critic(cfg, batch) -> dict:
    """A LoRA critic's trainable parameters and what two value updates changed."""
    from megarl.engines.megatron.roles import CriticEngine

    critic = CriticEngine(cfg)
    mine = batch.chunk(critic.dp_size)[critic.dp_rank]
    values = critic.compute_values(mine)
    mine["values"] = share_in_replica(values and values["values"])
    before = _params(critic)
    metrics = [critic.update_critic(mine) for _ in range(2)]
    after = _params(critic)
    return {
        "trainable": sorted(n for c in critic.model_chunks for n, p in c.named_parameters() if p.requires_grad),
        "changed": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "grad_buffer_numel": sum(b.grad_data.numel() for c in critic._ddp_chunks for b in c.buffers),
        "trainable_numel": sum(p.numel() for c in critic.model_chunks for p in c.parameters() if p.requires_grad),
        "adapter_numel": sum(p.numel() for a, _ in critic.lora_adapters for p in a.parameters()),
        "metrics": metrics,
    }


def lora_world(rank: int, world_size: int, port: int, models: dict, out_dir: str) -> dict:
    init_world(rank, world_size, port)
    batch = training_batch()
    model = models["qwen2"]
    out = {}
    out["tp1"] = _train(lora_config(model, world_size, 1, 1), batch, base_cfg=config(model, world_size, 1, 1),
                        export_dir=f"{out_dir}/merged_hf", checkpoint_dir=f"{out_dir}/{CHECKPOINT}/actor")
    reset_layout()
    out["tp1_resumed"] = _resume(lora_config(model, world_size, 1, 1), batch, f"{out_dir}/{CHECKPOINT}/actor",
                                 out["tp1"]["init_log_probs"])
    reset_layout()
    for layout, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():  # saved and resumed at TP2 and PP2 too
        directory = f"{out_dir}/{layout}/{CHECKPOINT}/actor"
        out[layout] = _train(lora_config(model, world_size, tp, pp), batch, checkpoint_dir=directory)
        reset_layout()
        out[f"{layout}_resumed"] = _resume(lora_config(model, world_size, tp, pp), batch, directory,
                                           out[layout]["init_log_probs"])
        reset_layout()
    out["critic_tp2"] = _critic(config(model, world_size, 2, 1, None, None, "critic.model.lora.rank=4",
                                       "critic.model.lora.alpha=8", "critic.optim.lr=1e-2"), batch)
    reset_layout()
    return out
