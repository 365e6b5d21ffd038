"""The body of the MTP training check, in two gloo worlds started once for the module. One rank
(`mtp_one_rank_world`) builds the actor of a tiny DeepSeek-V3 (one MTP layer) without
`model.mtp.enable_train` and scores a batch; then, each with a fresh MTP actor, one update with zero advantages
(the policy loss is 0, so the MTP loss alone makes the gradient), the same with detach_encoder, and one SFT
step; then CP 1's padded and packed updates. Two ranks (`mtp_two_rank_world`) do the same at PP 2, then CP 2's
updates."""
from __future__ import annotations

import torch

from engine_world import config, init_world, reset_layout

EH_PROJ = "mtp.layers.0.eh_proj.weight"
MTP = ["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true"]
ONE_MICRO_BATCH = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                   "actor_rollout_ref.actor.optim.clip_grad=1e9"]
DETACH_ENCODER = "actor_rollout_ref.model.mtp.detach_encoder=true"


def named(engine) -> dict[str, torch.nn.Parameter]:
    return dict(engine.model_chunks[0].named_parameters())


def _copy(batch):
    return batch.select(torch.arange(len(batch)))


def mtp_one_rank_world(rank: int, world_size: int, port: int, model_dir: str, batch) -> dict:
    """{"plain": the actor without MTP training's log-probs, "plain_names": its parameters' names,
    "policy" / "detach_encoder" / "sft": `_mtp_step`'s results (pushes with "policy" only), "cp": CP 1's
    `_cp_updates`}."""
    from megarl.engines.megatron.roles import ActorEngine

    init_world(rank, world_size, port)
    plain = ActorEngine(config(model_dir, 1, 1, 1, None, None, *ONE_MICRO_BATCH))
    out = {"plain": plain.compute_log_prob(batch, 1.0)["log_probs"],
           "plain_names": sorted(named(plain))}
    del plain
    reset_layout()
    for name, extra, sft in (("policy", [], False), ("detach_encoder", [DETACH_ENCODER], False), ("sft", [], True)):
        out[name] = _mtp_step(model_dir, _copy(batch), extra, sft, push=name == "policy")
        reset_layout()
    out["cp"] = _cp_updates(model_dir, world_size, batch, 1)
    return out


def _mtp_step(model_dir: str, batch, extra: list, sft: bool, push: bool) -> dict:
    """The MTP actor scores `batch` and makes one zero-advantage update, or (`sft`) one SFT step
    (`sft_step`); with `push` also what its weight push sends to drafting and to other servers."""
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(config(model_dir, 1, 1, 1, None, None, *ONE_MICRO_BATCH, *MTP, *extra))
    out = {"with_mtp": actor.compute_log_prob(batch, 1.0)["log_probs"]}
    batch["old_log_probs"] = out["with_mtp"]
    batch["advantages"] = torch.zeros_like(out["with_mtp"])
    out["metrics"] = actor.sft_step(batch) if sft else actor.update_policy(batch)
    params = named(actor)
    out["grads"] = {name: p.main_grad.detach().clone() for name, p in params.items()}
    if push:
        out["eh_proj"] = params[EH_PROJ].detach().clone()
        out["pushed_drafting"] = pushed(actor, servers_draft=True)
        out["pushed_names"] = sorted(pushed(actor, servers_draft=False))
    return out


def pushed(actor, servers_draft: bool) -> dict[str, torch.Tensor]:
    """The HF tensors the actor's weight push sends to servers that draft with the MTP layers, or do not."""
    from megarl.sync import ParallelGroups, Resharder
    from megarl.sync.weight_sync import servers_weight_map

    weights = servers_weight_map(actor.weight_map, servers_draft)
    sent = {}
    for bucket in Resharder(actor.model_chunks, weights, ParallelGroups.from_parallel_state(), 1 << 16).buckets():
        sent.update({name: tensor.clone() for name, tensor in bucket.named_tensors()})
    return sent


def mtp_two_rank_world(rank: int, world_size: int, port: int, model_dir: str, batch) -> dict:
    """{"pp": `_pp2`'s results, "cp": CP 2's `_cp_updates`} of this rank."""
    init_world(rank, world_size, port)
    out = {"pp": _pp2(model_dir, _copy(batch))}
    reset_layout()
    out["cp"] = _cp_updates(model_dir, world_size, batch, 2)
    return out


def _pp2(model_dir: str, batch) -> dict:
    """PP 2 (the dense layer on stage 0; the MoE layer and the MTP block, with its copy of the embedding, on
    stage 1): the same scoring and zero-advantage update; what each rank holds."""
    from megarl.engines.megatron.roles import ActorEngine

    pp2 = ONE_MICRO_BATCH + [f"actor_rollout_ref.{role}.megatron.pipeline_model_parallel_size=2"
                             for role in ("actor", "ref")]
    plain = ActorEngine(config(model_dir, 2, 1, 2, None, None, *pp2))
    out = {"plain": (plain.compute_log_prob(batch, 1.0) or {}).get("log_probs")}
    del plain
    reset_layout()
    actor = ActorEngine(config(model_dir, 2, 1, 2, None, None, *pp2, *MTP))
    scored = share_in_world(actor.compute_log_prob(batch, 1.0))
    out["with_mtp"] = scored["log_probs"]
    batch["old_log_probs"] = scored["log_probs"]
    batch["advantages"] = torch.zeros_like(scored["log_probs"])
    out["metrics"] = actor.update_policy(batch)
    out["grads"] = {name: p.main_grad.detach().clone() for name, p in named(actor).items()}
    out["pushed"] = sorted(pushed(actor, servers_draft=True))
    del actor
    return out


def share_in_world(value):
    """The one rank's non-None value on every rank."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return next(v for v in values if v is not None)


def _cp_updates(model_dir: str, world_size: int, batch, cp: int) -> dict:
    """Context parallel size `cp` (`world_size` = cp, DP 1): the zero-advantage update of the MTP actor with
    padded and with packed micro-batches; {layout: (metrics, every parameter's gradient)}."""
    from megarl.engines.megatron.roles import ActorEngine

    cp_keys = [f"actor_rollout_ref.{role}.megatron.context_parallel_size={cp}" for role in ("actor", "ref")]
    out = {}
    for layout in ("padded", "packed"):
        actor = ActorEngine(config(model_dir, world_size, 1, 1, None, None, *ONE_MICRO_BATCH, *MTP, *cp_keys),
                            layout)
        update = batch.select(torch.arange(len(batch)))
        update["old_log_probs"] = torch.zeros(update["response_mask"].shape)
        update["advantages"] = torch.zeros(update["response_mask"].shape)
        metrics = actor.update_policy(update)
        out[layout] = (metrics, {name: p.main_grad.detach().clone() for name, p in named(actor).items()})
        del actor
        reset_layout()
    return out
