"""Bodies of the FSDP2 engine checks (`megatron.use_torch_fsdp2`), run in gloo processes: the
same PPO updates with megatron's DDP (the oracle) and with FSDP2 (LAYOUTS: DP2, TP2, CP2 with full recompute, and
DP2 in bfloat16; PP_LAYOUTS: two pipeline stages; a critic at DP2; a tiny MoE at EP2 and EP1: MOE_LAYOUTS),
in one world."""
from __future__ import annotations

import torch
import torch.distributed as dist
from engine_world import ACTOR_LOSS, config, init_world, reset_layout, share_in_replica, training_batch

UPDATES = 3
# name: (TP, CP, optim.clip_grad, model.dtype, recompute) on 2 ranks; TP2 runs at DP1 without clipping, where
# FSDP2's step is bit for bit DDP's (no reduction over ranks, no norm that sums shards in another order);
# CP2 with full recompute (each layer's forward again in the backward: FSDP2 gathers its weights again)
LAYOUTS = {"dp2": (1, 1, 0.05, "float32", False), "tp2": (2, 1, 0.0, "float32", False),
           "cp2": (1, 2, 0.05, "float32", True), "dp2_bf16": (1, 1, 0.05, "bfloat16", False)}
RESUMED = ("dp2", "tp2", "dp2_bf16")  # saved after update UPDATES - 1, resumed in a new engine
# name: (model, VPP) at PP2 (DP1, TP1, float32, optim.clip_grad 0.05) on 2 ranks: llama's untied output layer
# under 1F1B; qwen2's tied embedding (the first stage's word embedding and the last stage's output layer, one
# weight) under the interleaved schedule, two model chunks a stage
PP_LAYOUTS = {"pp2": ("llama", None), "pp2_vpp2_tied": ("qwen2", 2)}
PP_RESUMED = "pp2_vpp2_tied"  # saved after update UPDATES - 1 and resumed (after trying dp2's PP1 checkpoint)
# a tiny Qwen3-MoE (8 experts, top 2) at DP2, float32, clipped, with megatron's load-balancing loss: name: EP size.
# EP2: each rank 4 experts, expert DP 1; EP1: every expert on both ranks, sharded over expert DP 2. moe_ep2 replays
# given routes (router_replay R3); both save after update UPDATES - 1 and resume.
MOE_LAYOUTS = {"moe_ep2": 2, "moe_ep1": 1}
MOE_REPLAYED = ("moe_ep2",)


def fsdp2_config(model_dir: str, world_size: int, tp: int, cp: int, clip_grad: float, dtype: str, recompute: bool,
                 fsdp2: bool, *extra: str):
    cp_keys = [f"{s}.megatron.context_parallel_size={cp}" for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")]
    return config(model_dir, world_size, tp, 1, None, None, *ACTOR_LOSS, *cp_keys,
                  "actor_rollout_ref.actor.optim.weight_decay=0.1",
                  f"actor_rollout_ref.actor.optim.clip_grad={clip_grad}",
                  "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
                  "actor_rollout_ref.actor.optim.total_training_steps=10",
                  "actor_rollout_ref.actor.optim.warmup_style=cosine",
                  f"actor_rollout_ref.actor.megatron.use_torch_fsdp2={str(fsdp2).lower()}",
                  f"actor_rollout_ref.model.dtype={dtype}",
                  f"actor_rollout_ref.model.enable_gradient_checkpointing={str(recompute).lower()}", *extra)


def pp_config(model_dir: str, vpp, fsdp2: bool):
    """A PP_LAYOUTS config: 2 pipeline stages on 2 ranks, `vpp` virtual stages each (None: 1F1B)."""
    pp_keys = [f"{s}.megatron.{key}" for s in ("actor_rollout_ref.actor", "actor_rollout_ref.ref")
               for key in ("pipeline_model_parallel_size=2",
                           f"virtual_pipeline_model_parallel_size={'null' if vpp is None else vpp}")]
    return fsdp2_config(model_dir, 2, 1, 1, 0.05, "float32", False, fsdp2, *pp_keys)


def chunk_parameters(actor):
    """(name, parameter) of every model chunk of this rank: megatron's local names, "<v>.<name>" in chunk
    v > 0 (virtual pipeline stages)."""
    for v, chunk in enumerate(actor.model_chunks):
        for name, param in chunk.named_parameters():
            yield (name if v == 0 else f"{v}.{name}"), param
def moe_config(model_dir: str, ep: int, fsdp2: bool, replay: bool):
    return fsdp2_config(model_dir, 2, 1, 1, 0.05, "float32", False, fsdp2,
                        *[f"actor_rollout_ref.{r}.megatron.expert_model_parallel_size={ep}" for r in ("actor", "ref")],
                        "actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=0.01",
                        f"actor_rollout_ref.actor.router_replay.mode={'R3' if replay else 'disabled'}")


# megatron's expert-bias update rate (megatron's default) set on the biased MoE's built TransformerConfig, which
# megatron's update reads at each step: megarl pins it to 0 (bridge.moe: the bias stays HF's, an override is
# refused), where the update leaves the bias as it is and a comparison could not fail
BIAS_RATE = 1e-3


def expert_biases(actor) -> dict[str, torch.Tensor]:
    """{buffer name: a clone} of the routers' `expert_bias` buffers of this rank's chunks ({} without)."""
    return {f"{v}.{name}": b.detach().clone() for v, chunk in enumerate(actor.model_chunks)
            for name, b in chunk.named_buffers() if name.endswith(".router.expert_bias")}


def routed(batch, layers: int = 2, experts: int = 8, k: int = 2):
    """`batch` with routes to replay (router_replay R3): for every token and layer k distinct random experts."""
    g = torch.Generator().manual_seed(11)
    for key, mask in (("prompt_routed_experts", "prompt_mask"), ("routed_experts", "response_mask")):
        b, n = batch[mask].shape
        batch[key] = torch.rand(b, n, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.uint8)
    return batch


def pushed(actor) -> dict[str, torch.Tensor]:
    """{HF name: tensor} of what this rank would send to the servers (the resharder's buckets, read in
    the engine's `weights_for_sync`, in the model's dtype); {} on ranks that emit nothing."""
    from megarl.bridge.fused_experts import fuses_experts
    from megarl.sync.groups import ParallelGroups
    from megarl.sync.resharder import Resharder

    groups = ParallelGroups.from_parallel_state(fused_experts=fuses_experts(actor.weight_map.arch))
    out = {}
    with actor.weights_for_sync():
        for bucket in Resharder(actor.model_chunks, actor.weight_map, groups, 2**20).buckets():
            out.update({name: t.clone() for name, t in bucket.named_tensors()})
    return out


def shards(actor) -> dict:
    """Per parameter name: whether its placements are torch's (Shard(0),), its mesh size, this rank's
    index in the DP x CP group, its local values and every rank's of the group (gathered with a plain
    all_gather_object, not through DTensor: its plans are cached by mesh ranks, and after a layout
    switch a new mesh over the same ranks would get the old one's, on a destroyed group).
    FSDP2 DTensors are float32 whatever the model's dtype."""
    from megatron.core import parallel_state
    from torch.distributed.tensor import Shard

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    out = {}
    for name, param in chunk_parameters(actor):
        local = param.to_local().detach().clone()
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        out[name] = {"shard0": param.placements == (Shard(0),), "mesh_size": param.device_mesh.size(),
                     "rank": dist.get_rank(group), "local": local, "parts": parts}
    return out


def whole_params(actor) -> dict[str, torch.Tensor]:
    """This rank's parameters (its TP shards) as plain tensors, gathered where FSDP2 shards them."""
    with actor.weights_for_sync():
        return {name: p.detach().clone() for name, p in chunk_parameters(actor)}


def wd_mults(optimizer, names: dict) -> dict[str, float]:
    """{parameter name: its group's `wd_mult`} of an optimizer over the model's parameters (`names`:
    id -> name); megatron's bf16 optimizer steps float32 copies, whose models are its `float16_groups`."""
    out = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        models = getattr(inner, "float16_groups", None)
        for index, group in enumerate(inner.param_groups):
            out.update({names[id(p)]: group["wd_mult"] for p in (models[index] if models else group["params"])})
    return out


def train_state(actor) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name: this rank's float32 shard ("param") and AdamW's state (`exp_avg`,
    `exp_avg_sq` shards, `step`), cloned."""
    out = {}
    for name, param in chunk_parameters(actor):
        state = actor.optimizer.optimizer.state.get(param, {})
        out[name] = {"param": param.to_local().detach().clone(),
                     **{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in state.items()}}
    return out


def offload_round_trip(actor, mine) -> dict:
    """Offload and onload between two updates, as colocated placement does, after a forward-only pass
    (which leaves FSDP2's root whole): everything at once, then in two steps (gradients and AdamW state
    before the weight push, parameters after). What each call moved, whether every parameter was a
    DTensor again with its local shard freed (and the gradients' and moments'), whether a forward was
    refused meanwhile, and whether the shards and AdamW state came back bit for bit."""
    from torch.distributed.tensor import DTensor

    def params() -> list:
        return list(actor.model_chunks[0].parameters())

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k])
                                                                               for k in a[n]) for n in a)

    def nbytes(t) -> int:
        return t.to_local().untyped_storage().nbytes()

    before = train_state(actor)
    actor.compute_log_prob(mine, 1.0)
    out = {"root_whole_before": any(not isinstance(p, DTensor) for p in params()), "full": actor.offload()}
    moments = [v for p in params() for k, v in actor.optimizer.optimizer.state[p].items() if k != "step"]
    grads = [p.grad for p in params()]
    out["freed"] = (all(isinstance(p, DTensor) and nbytes(p) == 0 for p in params())
                    and all(g is not None and nbytes(g) == 0 for g in grads) and all(nbytes(v) == 0 for v in moments))
    try:
        actor.compute_log_prob(mine, 1.0)
        out["refused_while_offloaded"] = None
    except RuntimeError as exc:
        out["refused_while_offloaded"] = str(exc)
    out["onload"] = actor.onload()
    out["restored"] = same(train_state(actor), before)
    out["grads_zeroed"] = all(torch.equal(g.to_local(), torch.zeros_like(g.to_local())) for g in grads)
    out["staged"] = [actor.offload(params=False)]
    out["params_kept_for_the_push"] = all(nbytes(p) > 0 for p in params())
    actor.offloader.check_onloaded(("params",))  # the push may read them
    out["staged"].append(actor.offload())
    out["staged_onload"] = actor.onload()
    out["staged_restored"] = same(train_state(actor), before)
    return out


def _train(cfg, batch, fsdp2: bool, ckpt: str | None = None, offload: bool = False, bias_rate: float = 0.0) -> dict:
    """UPDATES updates; with `ckpt`, the checkpoint saved there after update UPDATES - 1 (what it held:
    "at_save"); with `offload`, `offload_round_trip` after update UPDATES - 1 ("offload"); `bias_rate`: the
    routers' expert-bias update rate set on the model's TransformerConfig (BIAS_RATE)."""
    from megatron.core import parallel_state

    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    if bias_rate:
        actor.transformer_config.moe_router_bias_update_rate = bias_rate
    initial = pushed(actor)  # before any forward (FSDP2's lazy initialisation not run yet)
    initial_bias = expert_biases(actor)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    scored = actor.compute_log_prob(mine, 1.0)
    mine["old_log_probs"] = share_in_replica(scored and scored["log_probs"])
    result = {"dp_rank": actor.dp_rank, "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "fsdp2": actor.fsdp2,
              "use_distributed_optimizer": actor.use_distributed_optimizer,
              "old_log_probs": mine["old_log_probs"], "pushed_initial": initial, "metrics": [],
              "expert_bias_initial": initial_bias,
              # the DDP hooks megatron's schedules call where the model config sets them
              "schedule_hooks": [h for h in ("no_sync_func", "grad_sync_func", "finalize_model_grads_func")
                                 if getattr(actor.transformer_config, h, None) is not None]}
    for update in range(UPDATES):
        result["metrics"].append(actor.update_policy(mine))
        if ckpt is not None and update == UPDATES - 2:
            actor.save_checkpoint(ckpt)
            if fsdp2:
                result["at_save"] = {"pushed": pushed(actor), "state": train_state(actor), "updates": actor.updates,
                                     "lr": [g["lr"] for g in actor.optimizer.param_groups]}
        if offload and update == UPDATES - 2:
            result["offload"] = offload_round_trip(actor, mine)
    if actor.fsdp2:
        result["state"] = train_state(actor)
    result["scored_after"] = actor.compute_log_prob(mine, 1.0)
    result["params"] = whole_params(actor)
    names = {id(p): name for name, p in chunk_parameters(actor)}
    result["wd_mult"] = wd_mults(actor.optimizer, names)
    result["pushed"] = pushed(actor)
    result["expert_bias"] = expert_biases(actor)
    if fsdp2 or initial_bias:
        # a non-finite loss on one rank: every rank skips the update, the shards unchanged; the expert bias
        # (with DDP too: megatron's order) still moves by the skipped update's routing
        poisoned = mine.select(range(len(mine)))
        if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
            poisoned["advantages"] = torch.full_like(poisoned["advantages"], float("nan"))
        before = [p.to_local().clone() for p in actor.optimizer.params] if fsdp2 else None
        skipped = actor.update_policy(poisoned)["actor/skipped_updates"]
        result["poisoned"] = {"skipped": skipped, "unchanged": fsdp2 and all(
            torch.equal(a, p.to_local()) for a, p in zip(before, actor.optimizer.params))}
        if initial_bias:
            result["poisoned"]["expert_bias"] = expert_biases(actor)
    if fsdp2:
        result["shards"] = shards(actor)
        result["adam_state_shapes"] = {  # (parameter's local shape, its Adam moments' local shapes)
            names[id(p)]: (tuple(p.to_local().shape), tuple(tuple(v.to_local().shape) for k, v in
                                                            actor.optimizer.optimizer.state[p].items() if k != "step"))
            for p in actor.optimizer.params}
        try:
            actor.save_checkpoint("/nonexistent", background=True)
            result["refused"] = None
        except NotImplementedError as exc:
            result["refused"] = str(exc)
    return result


def _resume(cfg, batch, old_log_probs, ckpt: str, other_ckpt: str | None) -> dict:
    """A new engine: with `other_ckpt` (a checkpoint of another TP size), its optimizer-state load
    refused, its weights alone loaded (what the push then sends); then `ckpt` loaded (what it holds
    right after: "loaded") and update UPDATES of the uninterrupted run."""
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    mine = batch.chunk(actor.dp_size)[actor.dp_rank]
    mine["old_log_probs"] = old_log_probs
    out = {}
    if other_ckpt is not None:
        try:
            actor.load_checkpoint(other_ckpt)
            out["other_refused"] = None
        except ValueError as exc:
            out["other_refused"] = str(exc)
        actor.load_checkpoint(other_ckpt, optimizer=False)
        out["other_pushed"], out["other_updates"] = pushed(actor), actor.updates
    actor.load_checkpoint(ckpt)
    out["loaded"] = {"state": train_state(actor), "updates": actor.updates,
                     "lr": [g["lr"] for g in actor.optimizer.param_groups]}
    out["metrics"] = actor.update_policy(mine)
    out["state"], out["params"] = train_state(actor), whole_params(actor)
    return out


def _ddp_from_fsdp2(cfg, ckpt: str) -> dict:
    """A megatron-DDP engine given an FSDP2 checkpoint: the refusal of its optimizer state (None: none), then
    what the push sends once its weights alone are loaded."""
    from megarl.engines.megatron.roles import ActorEngine

    actor = ActorEngine(cfg)
    try:
        actor.load_checkpoint(ckpt)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    actor.load_checkpoint(ckpt, optimizer=False)
    return {"refused": refused, "pushed": pushed(actor)}


def fsdp2_world(rank: int, world_size: int, port: int, model_dir: str, layouts: list[str], ckpt_root: str,
                models: dict, moe_dir: str | None = None, biased_moe_dir: str | None = None) -> dict:
    """Each of `layouts` (names in LAYOUTS) with DDP then FSDP2: UPDATES PPO updates of one batch,
    then the metrics, log-probs after them, whole parameters, the push's tensors, and for FSDP2 the
    shards; the runs of RESUMED save a checkpoint under `ckpt_root` after update UPDATES - 1 (<layout>,
    DDP's <layout>_ddp), and ("resume", layout) is a new engine's resume from FSDP2's (at TP2, after
    trying dp2's). The same for PP_LAYOUTS (`models`: {name: HF directory}), PP_RESUMED resumed after
    trying dp2's checkpoint. FSDP2's dp2 run offloads and onloads after update UPDATES - 1; "verl_megatron_fsdp",
    the same engine under verl's key, never does. With `moe_dir` (a tiny MoE model) also MOE_LAYOUTS (`_moe`);
    with `biased_moe_dir` (an MoE whose routers have an expert bias, updated at BIAS_RATE) ("biased_moe", fsdp2)
    at EP2 with DDP then FSDP2, each also a skipped (non-finite) update after the UPDATES ones."""
    init_world(rank, world_size, port)
    batch = training_batch()
    out = {}
    for name in layouts:
        tp, cp, clip_grad, dtype, recompute = LAYOUTS[name]
        for fsdp2 in (False, True):
            ckpt = f"{ckpt_root}/{name}{'' if fsdp2 else '_ddp'}" if name in RESUMED else None
            out[(name, fsdp2)] = _train(fsdp2_config(model_dir, world_size, tp, cp, clip_grad, dtype, recompute, fsdp2),
                                         batch, fsdp2, ckpt, offload=fsdp2 and name == "dp2")
            reset_layout()
    if "dp2" in layouts:  # verl's Megatron-FSDP key (megatron's distributed optimizer flag left on, as verl sets it)
        tp, cp, clip_grad, dtype, recompute = LAYOUTS["dp2"]
        out["verl_megatron_fsdp"] = _train(fsdp2_config(model_dir, world_size, tp, cp, clip_grad, dtype, recompute, False,
                                                        "actor_rollout_ref.actor.megatron.use_megatron_fsdp=true",
                                                        "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true"),
                                           batch, False)
        reset_layout()
    for name in [n for n in RESUMED if n in layouts]:
        tp, cp, clip_grad, dtype, recompute = LAYOUTS[name]
        other = f"{ckpt_root}/dp2" if name == "tp2" and "dp2" in layouts else None
        out[("resume", name)] = _resume(fsdp2_config(model_dir, world_size, tp, cp, clip_grad, dtype, recompute, True),
                                        batch, out[(name, True)]["old_log_probs"], f"{ckpt_root}/{name}", other)
        reset_layout()
    if "dp2" in layouts:  # megatron's DDP given FSDP2's dp2 checkpoint: its optimizer state refused, its weights load
        tp, cp, clip_grad, dtype, recompute = LAYOUTS["dp2"]
        out["ddp_from_fsdp2"] = _ddp_from_fsdp2(fsdp2_config(model_dir, world_size, tp, cp, clip_grad, dtype, recompute,
                                                             False), f"{ckpt_root}/dp2")
        reset_layout()
    for name, (model, vpp) in PP_LAYOUTS.items():
        for fsdp2 in (False, True):
            ckpt = f"{ckpt_root}/{name}{'' if fsdp2 else '_ddp'}" if name == PP_RESUMED else None
            out[(name, fsdp2)] = _train(pp_config(models[model], vpp, fsdp2), batch, fsdp2, ckpt)
            reset_layout()
    other = f"{ckpt_root}/dp2" if "dp2" in layouts else None
    model, vpp = PP_LAYOUTS[PP_RESUMED]
    out[("resume", PP_RESUMED)] = _resume(pp_config(models[model], vpp, True), batch,
                                          out[(PP_RESUMED, True)]["old_log_probs"], f"{ckpt_root}/{PP_RESUMED}", other)
    reset_layout()
    if moe_dir is not None:
        out.update(_moe(model_dir=moe_dir, ckpt_root=ckpt_root, batch=batch))
    if biased_moe_dir is not None:  # a router expert bias (megatron DDP updates it in finalize_model_grads)
        for fsdp2 in (False, True):
            out[("biased_moe", fsdp2)] = _train(moe_config(biased_moe_dir, 2, fsdp2, False), batch, fsdp2,
                                                 bias_rate=BIAS_RATE)
            reset_layout()
    for fsdp2 in (False, True):  # a critic at DP2 (its value head read inside the forward step, as the output layer)
        out[("critic", fsdp2)] = _train_critic(config(model_dir, world_size, 1, 1, None, model_dir,
                                                      f"critic.megatron.use_torch_fsdp2={str(fsdp2).lower()}"), batch)
        reset_layout()
    return out


def _moe(model_dir: str, ckpt_root: str, batch) -> dict:
    """Each of MOE_LAYOUTS with DDP then FSDP2 (as `fsdp2_world`, FSDP2's checkpoint under `ckpt_root`/<name>),
    then ("resume", name): a new FSDP2 engine resumed from it, at EP1 after trying moe_ep2's checkpoint."""
    out = {}
    for name, ep in MOE_LAYOUTS.items():
        mine = routed(batch.select(range(len(batch)))) if name in MOE_REPLAYED else batch
        for fsdp2 in (False, True):
            out[(name, fsdp2)] = _train(moe_config(model_dir, ep, fsdp2, name in MOE_REPLAYED), mine, fsdp2,
                                        f"{ckpt_root}/{name}{'' if fsdp2 else '_ddp'}")
            reset_layout()
    for name, ep in MOE_LAYOUTS.items():
        mine = routed(batch.select(range(len(batch)))) if name in MOE_REPLAYED else batch
        other = f"{ckpt_root}/moe_ep2" if name == "moe_ep1" else None
        out[("resume", name)] = _resume(moe_config(model_dir, ep, True, name in MOE_REPLAYED), mine,
                                        out[(name, True)]["old_log_probs"], f"{ckpt_root}/{name}", other)
        reset_layout()
    return out


def fsdp2_dp1_resume(rank: int, world_size: int, port: int, model_dir: str, ckpt: str, old_log_probs) -> dict:
    """One rank (DP1) resuming the dp2 layout's checkpoint `ckpt` (DCP reshards its two DP shards):
    what it holds right after the load, then update UPDATES on the whole batch (its metrics, weights)."""
    from megarl.engines.megatron.roles import ActorEngine

    init_world(rank, world_size, port)
    actor = ActorEngine(fsdp2_config(model_dir, 1, *LAYOUTS["dp2"], True))
    batch = training_batch()
    batch["old_log_probs"] = old_log_probs
    actor.load_checkpoint(ckpt)
    out = {"loaded": train_state(actor), "updates": actor.updates}
    out["metrics"] = actor.update_policy(batch)
    out["params"] = whole_params(actor)
    return out


def _train_critic(cfg, batch) -> list[dict]:
    from megarl.engines.megatron.roles import CriticEngine

    critic = CriticEngine(cfg)
    mine = batch.chunk(critic.dp_size)[critic.dp_rank]
    values = critic.compute_values(mine)
    mine["values"] = share_in_replica(values and values["values"])
    return [critic.update_critic(mine) for _ in range(UPDATES)]
