"""Bodies of the real megatron-core engine checks, run in gloo processes.

Each world is started once and runs several layouts in turn (megatron's parallel state is
destroyed and re-initialised between engines), because starting processes and importing
megatron costs far more than the checks. Ranks return what the test process compares with the
HF model: per-token results from output ranks, metrics, local state dicts.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megarl.config import load_config
from megarl.data.batch import Batch
from megarl.engines.megatron.groups import release_model_parallel

VOCAB = 47  # the tiny tokenizer's vocabulary; ids 4.. are characters


def ragged_batch(size: int, seed: int = 0) -> Batch:
    """Prompts of 2-8 tokens (left-padded), responses of 1-10 tokens (right-padded)."""
    g = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        return torch.randint(4, VOCAB, (n,), generator=g).tolist()

    prompts = [tokens(2, 8) for _ in range(size)]
    responses = [tokens(1, 10) for _ in range(size)]
    return Batch.from_token_lists(prompts, responses)


def hf_log_probs(model_dir, batch: Batch, temperature: float, dtype=torch.float32) -> torch.Tensor:
    """The oracle: [B, R] log p(response_t | prompt, response_<t) under softmax(logits / T) by HF
    transformers' own model (logits in `dtype`, then float32), 0 at padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    out = torch.zeros(batch["response_mask"].shape)
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        with torch.no_grad():
            logits = model(torch.cat([prompt, response])[None]).logits[0].float()
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        out[i, :len(response)] = (logits / temperature).log_softmax(-1)[at, response]
    return out


def config(model_dir, world: int, tp: int = 1, pp: int = 1, vpp=None, critic_dir=None, *extra: str):
    """An experiment config for a `world`-rank role at TP x PP (x VPP), float32, tiny batches."""
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.dtype=float32",
        f"critic.model.path={critic_dir or model_dir}",
        f"trainer.n_gpus_per_node={world}",
        "trainer.device=cpu",
        "actor_rollout_ref.rollout.name=cpu",
        "data.train_batch_size=8",
        "data.max_response_length=10",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "critic.optim.lr=1e-4",
    ]
    for section in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        overrides += [
            f"{section}.megatron.tensor_model_parallel_size={tp}",
            f"{section}.megatron.pipeline_model_parallel_size={pp}",
            f"{section}.megatron.virtual_pipeline_model_parallel_size={'null' if vpp is None else vpp}",
            f"{section}.megatron.use_distributed_optimizer=false",
        ]
    return load_config(None, overrides + list(extra))


def init_world(rank: int, world_size: int, port: int) -> None:
    """What a worker group does before building an engine: torch.distributed over the role's ranks."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))


def reset_layout() -> None:
    release_model_parallel()


def share_in_replica(value):
    """The output rank's value on every rank of its DP replica (TP x PP x CP ranks: what the
    controller's data flow provides in a real run)."""
    from megatron.core import parallel_state

    mine = parallel_state.get_data_parallel_rank()
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, (mine, value))
    return next(v for dp, v in values if dp == mine and v is not None)


def local_state(engine) -> dict:
    """{(pp_rank, vp_stage, tp_rank): local state dict} of this rank, for `bridge.merge_model`."""
    from megatron.core import parallel_state

    key = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    return {
        (key[0], v, key[1]): {k: t.detach().clone() for k, t in chunk.state_dict().items() if "_extra_state" not in k}
        for v, chunk in enumerate(engine.model_chunks)
    }


# ------------------------------------------------------------------------------------------ world A
# (model, TP, PP, VPP) on 4 ranks (TRAINING_WORLD_LAYOUTS on 2); qwen2_verl: see model_config
LAYOUTS = [("qwen2", 2, 1, None), ("qwen2", 1, 2, None), ("qwen2", 2, 2, None), ("qwen2", 1, 2, 2),
           ("llama", 2, 2, None), ("qwen2_mcore", 2, 1, None), ("qwen2_verl", 1, 2, None)]


def model_config(models: dict, name: str) -> tuple:
    """(model.path, extra overrides) of a LAYOUTS model. "qwen2_verl": verl's use_dist_checkpointing,
    the weights from qwen2's bare torch_dist directory, the config from another qwen2 checkpoint."""
    if name != "qwen2_verl":
        return models[name], ()
    return models["qwen2_reseeded"], tuple(
        f"actor_rollout_ref.{role}.megatron.{key}" for role in ("actor", "ref") for key in (
            "use_dist_checkpointing=true", f"dist_checkpointing_path={models['qwen2_verl_dist']}"))
TEMPERATURE = 0.7
# LAYOUTS that the 2-rank training world scores (at DP1, half the processes of the 4-rank world): qwen2's
# with actors it builds anyway, before they train or load a checkpoint (its TP2 actor, its TP1 x PP2 one),
# the torch_dist ones with actors of their own; the key of their results there
TRAINING_WORLD_LAYOUTS = {("qwen2", 2, 1, None): "tp2", ("qwen2", 1, 2, None): "resumed",
                          ("qwen2_mcore", 2, 1, None): "qwen2_mcore", ("qwen2_verl", 1, 2, None): "qwen2_verl"}


def score_layout(actor) -> dict:
    """A LAYOUTS check's scoring: the actor's slice of ragged_batch(8), log-probs and entropies at TEMPERATURE."""
    batch = ragged_batch(8)
    scored = actor.compute_log_prob(batch.chunk(actor.dp_size)[actor.dp_rank], TEMPERATURE, with_entropy=True)
    return {"output_rank": actor.is_output_rank, "dp_rank": actor.dp_rank, "scored": scored}


TRAINED_LAYOUTS = [("qwen2", 2, 2, None), ("qwen2", 1, 2, 2)]  # 1F1B at DP1, interleaved at DP2


def layouts_world(rank: int, world_size: int, port: int, models: dict) -> dict:
    """Log-probs and entropies at every layout of LAYOUTS but TRAINING_WORLD_LAYOUTS (each DP rank scores
    its slice of one ragged batch). At TRAINED_LAYOUTS also two PPO updates on the same data, and at TP2 x PP2 the
    step-0 invariant: reference log-probs equal the actor's exactly."""
    from megarl.engines.megatron.roles import ActorEngine, RefEngine

    init_world(rank, world_size, port)
    batch = ragged_batch(8)
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    out = {"scores": {}, "output_ranks": {}, "updates": {}}
    for layout in LAYOUTS:
        if layout in TRAINING_WORLD_LAYOUTS:
            continue
        name, tp, pp, vpp = layout
        model_dir, extra = model_config(models, name)
        cfg = config(model_dir, world_size, tp, pp, vpp, None,
                     f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", *extra)
        actor = ActorEngine(cfg)
        mine = batch.chunk(actor.dp_size)[actor.dp_rank]
        scored = actor.compute_log_prob(mine, TEMPERATURE, with_entropy=True)
        out["output_ranks"][layout] = actor.is_output_rank
        if scored is not None:
            out["scores"][(layout, actor.dp_rank)] = scored
        if layout == TRAINED_LAYOUTS[0]:
            ref_scored = RefEngine(cfg).compute_ref_log_prob(mine, TEMPERATURE)
            if ref_scored is not None:
                out["ref_equal"] = torch.equal(ref_scored["ref_log_probs"], scored["log_probs"])
        if layout in TRAINED_LAYOUTS:
            mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
            out["updates"][layout] = [actor.update_policy(mine) for _ in range(2)]
        del actor
        reset_layout()
    return out


# ------------------------------------------------------------------------------------------ world B
ACTOR_LOSS = (
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.1",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
)
UPDATES, SAVE_AFTER = 4, 2


def training_batch(seed: int = 1) -> Batch:
    batch = ragged_batch(8, seed)
    g = torch.Generator().manual_seed(seed)
    mask = batch["response_mask"].float()
    batch["advantages"] = torch.randn(len(batch), 1, generator=g) * mask
    batch["ref_log_probs"] = (-3.8 + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    batch["returns"] = torch.randn(mask.shape, generator=g) * mask
    return batch


def _snapshot(engine) -> list[torch.Tensor]:
    """Copies of every parameter, gradient buffer and optimizer-state tensor (offload check)."""
    params, grads, state = engine.offloader.storages()
    return [torch.tensor([], dtype=torch.uint8).set_(s).clone() for s in params + state]


def built_with(engine) -> dict:
    """The fusion flags of the engine's TransformerConfig and the overlap settings of its DDP config."""
    fusions = ("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion", "gradient_accumulation_fusion",
               "masked_softmax_fusion", "persist_layer_norm", "cross_entropy_loss_fusion")
    ddp = engine._ddp_chunks[0].ddp_config
    return {"fusions": {k: getattr(engine.transformer_config, k) for k in fusions},
            "overlap": {k: getattr(ddp, k)
                        for k in ("overlap_grad_reduce", "overlap_param_gather", "align_param_gather")}}


def _train_actor(cfg, batch, checkpoint_dir=None, score=False) -> dict:
    """`score`: "layout_scores", `score_layout` of the fresh actor, too."""
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    layout_scores = score_layout(actor) if score else None
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, 1.0)
    mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    result = {"old_log_probs": scored and scored["log_probs"], "dp_rank": actor.dp_rank, "metrics": [],
              "built_with": built_with(actor), "layout_scores": layout_scores}
    for update in range(1, UPDATES + 1):
        result["metrics"].append(actor.update_policy(mine))
        if update == SAVE_AFTER and checkpoint_dir is not None:
            before = _snapshot(actor)
            result["offload"] = actor.offload()
            params = [p for chunk in actor.model_chunks for p in chunk.parameters()]
            result["freed"] = all(p.untyped_storage().nbytes() == 0 for p in params)
            try:
                actor.compute_log_prob(mine, 1.0)
                result["refused_while_offloaded"] = False
            except RuntimeError:
                result["refused_while_offloaded"] = True
            result["onload"] = actor.onload()
            result["restored"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(actor)))
            # in two steps, as colocated: gradients and optimizer state before the push, parameters after
            staged = [actor.offload(params=False), None]
            result["params_kept_for_the_push"] = all(p.untyped_storage().nbytes() > 0 for p in params)
            actor.offloader.check_onloaded(("params",))  # the push may read them
            staged[1] = actor.offload()  # what is left: the parameters
            result["staged_offload"] = staged
            result["staged_onload"] = actor.onload()
            result["staged_restored"] = all(torch.equal(a, b) for a, b in zip(before, _snapshot(actor)))
            actor.save_checkpoint(checkpoint_dir)
    result["state"] = local_state(actor)
    return result


def _resume(cfg, batch, checkpoint_dir, old_log_probs, score=False) -> dict:
    """A fresh actor loaded from `checkpoint_dir`, trained for the remaining updates.
    `old_log_probs`: this rank's slice, or (DP1) the whole batch's. `score`: "layout_scores",
    `score_layout` of the actor before it loads the checkpoint (the HF weights), too."""
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    layout_scores = score_layout(actor) if score else None
    actor.load_checkpoint(checkpoint_dir)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    mine["old_log_probs"] = share_in_replica(old_log_probs)
    result = {"updates": actor.updates, "metrics": [actor.update_policy(mine) for _ in range(UPDATES - SAVE_AFTER)],
              "layout_scores": layout_scores}
    # A non-finite loss on one rank: every rank skips the update and the weights stay as they were.
    poisoned = mine.select(range(len(mine)))
    if actor.dp_rank == 0:
        poisoned["advantages"] = torch.full_like(poisoned["advantages"], float("nan"))
    before = [p.detach().clone() for chunk in actor.model_chunks for p in chunk.parameters()]
    metrics = actor.update_policy(poisoned)
    after = [p.detach() for chunk in actor.model_chunks for p in chunk.parameters()]
    result["poisoned"] = {"skipped": metrics["actor/skipped_updates"],
                          "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)),
                          "next_skipped": actor.update_policy(mine)["actor/skipped_updates"]}
    return result


def training_world(rank: int, world_size: int, port: int, models: dict, checkpoint_dir: str) -> dict:
    """The same PPO updates at TP1 (DP2, distributed optimizer, fixed micro-batches) and at TP2
    (DP1, token-budget micro-batches), each with offload/onload and a checkpoint after update 2;
    the TP1 checkpoint resumed at TP1, the TP2 one at TP1 x PP2; critics from the actor and from a
    reward model. The TP2 and TP1 x PP2 actors score their TRAINING_WORLD_LAYOUTS first; actors of
    the torch_dist models score theirs."""
    from megarl.engines.megatron.roles import ActorEngine, CriticEngine

    init_world(rank, world_size, port)
    batch = training_batch()
    out = {}
    distributed_optimizer = config(models["qwen2"], world_size, 1, 1, None, None, *ACTOR_LOSS,
                                   "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true")
    out["tp1"] = _train_actor(distributed_optimizer, batch, checkpoint_dir + "_tp1")
    reset_layout()
    out["tp1_resumed"] = _resume(distributed_optimizer, batch, checkpoint_dir + "_tp1", out["tp1"]["old_log_probs"])
    reset_layout()
    out["tp2"] = _train_actor(
        config(models["qwen2"], world_size, 2, 1, None, None, *ACTOR_LOSS,
               "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=30"),
        batch, checkpoint_dir, score=True)
    reset_layout()

    # TP2 ran at DP1: rank 0 has all old log-probs
    out["resumed"] = _resume(config(models["qwen2"], world_size, 1, 2, None, None, *ACTOR_LOSS), batch, checkpoint_dir,
                             share_in_world(out["tp2"]["old_log_probs"]), score=True)
    reset_layout()

    for name in ("qwen2", "qwen2_rm"):
        critic = CriticEngine(config(models["qwen2"], world_size, 2, 1, None, models[name]))
        mine = batch.chunk(critic.dp_size)[critic.dp_rank]
        values = critic.compute_values(mine)
        mine["values"] = share_in_replica(values and values["values"])
        out[name + "_critic"] = {
            "values": values and values["values"],
            "head": critic.model_chunks[-1].output_layer.weight.detach().clone(),
            "metrics": [critic.update_critic(mine) for _ in range(3)],
        }
        del critic
        reset_layout()
    for (name, tp, pp, vpp), key in TRAINING_WORLD_LAYOUTS.items():
        if key == name:  # a model of its own
            model_dir, extra = model_config(models, name)
            actor = ActorEngine(config(model_dir, world_size, tp, pp, vpp, None, *extra))
            out[key] = {"layout_scores": score_layout(actor)}
            del actor
            reset_layout()
    return out


def share_in_world(value):
    """Rank 0's value on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ------------------------------------------------------------------------------------------ world C
BF16_VOCAB = 4000  # bf16 model: a vocabulary large enough that a low-precision softmax would show


def bf16_batch(seed: int = 2) -> Batch:
    """Prompts of 8-48 tokens, responses of 16-64, ids over the whole BF16_VOCAB."""
    g = torch.Generator().manual_seed(seed)

    def tokens(low, high):
        n = int(torch.randint(low, high + 1, (1,), generator=g))
        return torch.randint(4, BF16_VOCAB, (n,), generator=g).tolist()

    batch = Batch.from_token_lists([tokens(8, 48) for _ in range(8)], [tokens(16, 64) for _ in range(8)])
    batch["advantages"] = torch.randn(len(batch), 1, generator=g) * batch["response_mask"]
    return batch


def bf16_world(rank: int, world_size: int, port: int, model_dir: str) -> dict:
    """The actor and the reference in bfloat16 at TP2: log-probs (temperature 0.7) of one ragged
    batch, whether the reference's equal the actor's, and the first update's metrics."""
    from megarl.engines.megatron.roles import ActorEngine, RefEngine

    init_world(rank, world_size, port)
    cfg = config(model_dir, world_size, 2, 1, None, None, "actor_rollout_ref.model.dtype=bfloat16",
                 "actor_rollout_ref.rollout.temperature=0.7")
    batch = bf16_batch()
    actor = ActorEngine(cfg)
    scored = actor.compute_log_prob(batch, 0.7)  # on the output rank; None on the other
    ref = RefEngine(cfg).compute_ref_log_prob(batch, 0.7)
    batch["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    return {"log_probs": batch["old_log_probs"],
            "ref_equal": scored is None or torch.equal(ref["ref_log_probs"], scored["log_probs"]),
            "param_dtypes": sorted({str(p.dtype) for c in actor.model_chunks for p in c.parameters()}),
            "first_update": actor.update_policy(batch)}
