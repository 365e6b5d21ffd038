"""The body of the MTP checkpoint check: one gloo process trains the actor of a tiny DeepSeek-V3 with its MTP
layer (`model.mtp.enable_train`) for one update, saves a checkpoint, makes a second update; a fresh actor
resumes from the checkpoint and makes the same second update; a third actor is built from the converter's
`torch_dist` copy of the HF checkpoint with its MTP layer."""
from __future__ import annotations

import torch

from engine_world import config, init_world, reset_layout, training_batch
from mtp_engine_world import MTP


def spelled_as_016(name: str) -> str:
    """An MTP layer's decoder layer is `transformer_layer` in megatron-core 0.16, `mtp_model_layer` in 0.19."""
    return name.replace(".mtp_model_layer.", ".transformer_layer.")


def parameters(engine) -> dict[str, torch.Tensor]:
    """Every parameter and router selection bias (a buffer) of the one chunk, by local name (`spelled_as_016`)."""
    chunk = engine.model_chunks[0]
    named = {**dict(chunk.named_parameters()),
             **{n: b for n, b in chunk.named_buffers() if n.endswith("mlp.router.expert_bias")}}
    return {spelled_as_016(name): t.detach().clone() for name, t in named.items()}


def optimizer_state(engine) -> dict[str, dict]:
    """The torch optimizer's state of each parameter, by the parameter's local name (`spelled_as_016`)."""
    names = {id(p): spelled_as_016(n) for n, p in engine.model_chunks[0].named_parameters()}
    out = {}
    for inner in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                state = inner.optimizer.state.get(p, {})
                out[names[id(p)]] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()}
    return out


def mtp_checkpoint_world(rank: int, world_size: int, port: int, model_dir: str, mcore_dir: str,
                         checkpoint_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    init_world(rank, world_size, port)
    batch = training_batch()
    cfg = config(model_dir, 1, 1, 1, None, None, *MTP)
    actor = ActorEngine(cfg)
    batch["old_log_probs"] = actor.compute_log_prob(batch, 1.0)["log_probs"]
    out = {"initial": parameters(actor), "first": actor.update_policy(batch)}
    actor.save_checkpoint(checkpoint_dir)
    out["saved"] = parameters(actor)
    out["continued"] = (actor.update_policy(batch), parameters(actor), optimizer_state(actor))
    del actor
    reset_layout()
    resumed = ActorEngine(cfg)
    resumed.load_checkpoint(checkpoint_dir)
    out["resumed_updates"] = resumed.updates
    out["resumed"] = (resumed.update_policy(batch), parameters(resumed), optimizer_state(resumed))
    del resumed
    reset_layout()
    out["converted"] = parameters(ActorEngine(config(mcore_dir, 1, 1, 1, None, None, *MTP)))
    reset_layout()
    return out
