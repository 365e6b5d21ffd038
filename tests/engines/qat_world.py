"""The body of tests/engines/test_qat.py: one 2-rank gloo world of real megatron-core on CPU. A QAT actor
(`actor_rollout_ref.actor.megatron.qat.enable=true`, float32) at TP 1 (DP 2) scores a batch, makes one SFT
step (ranks return the gradients megatron accumulated) and pushes its weights into a CPU engine; then the
same at TP 2 after a push only. At TP 1 it also saves a checkpoint (resumed by another engine) and
exports HF weights. A reference built from the same config (it shares the actor's megatron
keys, qat included) scores the batch too: verl quantizes trained engines only."""
from __future__ import annotations

import torch

from megarl.rollout.client import RolloutClient

from engine_world import config, init_world, reset_layout, share_in_replica

QAT = ("actor_rollout_ref.actor.megatron.qat.enable=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
       "actor_rollout_ref.actor.optim.clip_grad=1e9")
GRADS = ("decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.1.mlp.linear_fc2.weight")


def _push(actor, url: str, version: int) -> dict:
    from megarl.sync import SyncConfig, WeightSync

    sync = WeightSync(actor.model_chunks, actor.weight_map, [url], SyncConfig(
        transport="distributed", backend="gloo", bucket_bytes=1 << 16, check_weights=True, timeout_s=60))
    try:
        return sync.push(version=version)
    finally:
        sync.close()


def _gathered(value):
    """The output ranks' [B_dp, R] results on every rank, in DP order (None from the other ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (parallel_state.get_data_parallel_rank(), value))
    return torch.cat([v for _, v in sorted((dp, v) for dp, v in parts if v is not None)])


def served_log_probs(url: str, batch) -> torch.Tensor:
    """[B, R]: the rollout server's log-probs of the batch's responses (SGLang's input log-probs)."""
    sequences, starts = [], []
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        response = batch["response_ids"][i][batch["response_mask"][i].bool()].tolist()
        sequences.append(prompt + response)
        starts.append(len(prompt) - 1)
    with RolloutClient(url, max_retries=1, vocab_size=47) as client:
        scores = client.score(sequences, starts)
    out = torch.zeros(batch["response_mask"].shape)
    for i, row in enumerate(scores):
        out[i, :len(row)] = torch.tensor(row)
    return out



def qat_world(rank: int, world_size: int, port: int, model_dir: str, batch, url: str, out_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine, RefEngine

    init_world(rank, world_size, port)
    out = {}
    cfg = config(model_dir, world_size, 1, 1, None, None, *QAT)
    actor = ActorEngine(cfg)
    out["quantized"] = actor.qat_linears
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, 1.0)
    out["log_probs"] = _gathered(scored and scored["log_probs"])
    mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    masters = {n: p.detach().clone() for n, p in actor.model_chunks[0].named_parameters() if n in GRADS}
    out["sft"] = actor.sft_step(mine)
    params = dict(actor.model_chunks[0].named_parameters())
    out["grads"] = {n: params[n].main_grad.detach().clone() for n in GRADS}
    out["masters"] = masters
    scored = actor.compute_log_prob(mine, 1.0)
    out["trained_log_probs"] = _gathered(scored and scored["log_probs"])
    out["push_tp1"] = _push(actor, url, 1)
    out["served_after_tp1_push"] = served_log_probs(url, batch) if rank == 0 else None
    actor.save_checkpoint(f"{out_dir}/checkpoint")
    actor.export_hf(f"{out_dir}/hf")
    trained = {n: p.detach().clone() for n, p in actor.model_chunks[0].named_parameters()}
    out["trained_masters"] = {n: trained[n] for n in GRADS}
    del actor
    reset_layout()
    resumed = ActorEngine(cfg)
    resumed.load_checkpoint(f"{out_dir}/checkpoint")
    out["resumed_equal"] = all(torch.equal(trained[n], p) for n, p in resumed.model_chunks[0].named_parameters())
    scored = resumed.compute_log_prob(mine, 1.0)
    out["resumed_log_probs"] = _gathered(scored and scored["log_probs"])
    del resumed
    reset_layout()
    reference = RefEngine(cfg)
    scored = reference.compute_ref_log_prob(batch.chunk(reference.dp_size)[reference.dp_rank], 1.0)
    out["ref_log_probs"] = _gathered(scored and scored["ref_log_probs"])
    del reference
    reset_layout()
    actor = ActorEngine(config(model_dir, world_size, 2, 1, None, None, *QAT))
    scored = actor.compute_log_prob(batch, 1.0)
    out["tp2_log_probs"] = _gathered(scored and scored["log_probs"])
    out["push_tp2"] = _push(actor, url, 2)
    reset_layout()
    return out
