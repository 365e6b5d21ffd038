"""Body of the uneven-pipeline-stages check, run in gloo processes.

`uneven_world` (2 ranks): the actor at PP1 (DP2), then at PP2 with megatron's uneven split
(`num_layers_in_first_pipeline_stage=1`: layers [1, 3]; `num_layers_in_last_pipeline_stage=1`:
[3, 1]): scores, one PPO update, scores after it; the resharder's tensors after the update; the
[1, 3] actor saves a checkpoint, which an actor at PP1 loads. `pp3_world` (3 ranks): PP3 with
`num_layers_in_first_pipeline_stage=2` ([2, 1, 1]) scores, then PP3 with megatron's
`account_for_embedding_in_pipeline_split` and `account_for_loss_in_pipeline_split` (4 layers + 2
cut into 3 stages of 2, the first and the last giving one to the embedding / the loss: [1, 2, 1]).
"""
from __future__ import annotations

from context_parallel_world import TEMPERATURE, _actor
from engine_world import ACTOR_LOSS, config, init_world, reset_layout, training_batch

KEY = "actor_rollout_ref.actor.megatron.override_transformer_config"


def _uneven(first=None, last=None) -> list[str]:
    return [f"+{KEY}.num_layers_in_{name}_pipeline_stage={value}"
            for name, value in (("first", first), ("last", last)) if value is not None]


def _config(model_dir, world_size, pp, *extra):
    return config(model_dir, world_size, 1, pp, None, None, "actor_rollout_ref.rollout.n=1",
                  f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", *ACTOR_LOSS, *extra)


def _stage_layers(engine) -> list[int]:
    """Layers this rank's chunks build, with their global numbers (megatron's `layer_number`, from 1)."""
    return [layer.layer_number for chunk in engine.model_chunks for layer in chunk.decoder.layers]


def _global_state(engine) -> dict:
    """This rank's parameters by global name, each layer's numbered as megatron numbered it."""
    from megarl.bridge.sharding import layer_index, shift_layer

    out = {}
    for chunk in engine.model_chunks:
        for name, tensor in chunk.state_dict().items():
            if "_extra_state" in name:
                continue
            layer = layer_index(name)
            if layer is not None:
                name = shift_layer(name, chunk.decoder.layers[layer].layer_number - 1 - layer)
            out[name] = tensor.detach().clone()
    return out


def uneven_world(rank: int, world_size: int, port: int, model_dir: str, checkpoint_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    init_world(rank, world_size, port)
    out = {}
    for name, pp, extra, save in (("pp1", 1, [], None), ("first1", 2, _uneven(first=1), checkpoint_dir),
                                  ("last1", 2, _uneven(last=1), None)):
        out[name] = _actor(_config(model_dir, world_size, pp, *extra), save)
        reset_layout()
    resumed = ActorEngine(_config(model_dir, world_size, 1))
    resumed.load_checkpoint(checkpoint_dir)
    out["resumed"] = {"state": _global_state(resumed), "updates": resumed.updates}
    reset_layout()
    saved = ActorEngine(_config(model_dir, world_size, 2, *_uneven(first=1)))
    saved.load_checkpoint(checkpoint_dir)  # the saved weights, read back at the layout that saved them
    out["first1"].update(layers=_stage_layers(saved), saved=_global_state(saved))
    reset_layout()
    out["last1"]["layers"] = _stage_layers(ActorEngine(_config(model_dir, world_size, 2, *_uneven(last=1))))
    reset_layout()
    return out


def pp3_world(rank: int, world_size: int, port: int, model_dir: str) -> dict:
    from megarl.engines.megatron.roles import ActorEngine

    init_world(rank, world_size, port)
    actor = ActorEngine(_config(model_dir, world_size, 3, *_uneven(first=2)))
    out = {"layers": _stage_layers(actor), "dp_rank": actor.dp_rank,
           "scored": actor.compute_log_prob(training_batch(), TEMPERATURE, with_entropy=True)}
    reset_layout()
    actor = ActorEngine(_config(model_dir, world_size, 3, f"+{KEY}.account_for_embedding_in_pipeline_split=true",
                                f"+{KEY}.account_for_loss_in_pipeline_split=true"))
    out["split"] = {"layers": _stage_layers(actor),
                    "scored": actor.compute_log_prob(training_batch(), TEMPERATURE, with_entropy=True)}
    return out
