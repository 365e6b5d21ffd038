"""Body of the hidden-states model check, run in one gloo process (see engine_world.py)."""
from __future__ import annotations

import torch
from engine_world import config, init_world, ragged_batch, reset_layout


def hidden_states_world(rank: int, world_size: int, port: int, models: dict) -> dict:
    """For each tiny model (tied and untied output layer), one padded micro-batch through the
    engine's last-stage chunk and through a plain megatron `GPTModel` holding the same weights:
    {name: {"hidden": the chunk's output [S, b, H], "final_norm": what the decoder's final norm
    returned in that pass, "logits": the plain model's logits [b, S, V], "output_weight"}}."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megarl.bridge.megatron_config import gpt_model_kwargs, layer_spec
    from megarl.engines.megatron.roles import RefEngine

    init_world(rank, world_size, port)
    out = {}
    for name in ("qwen2", "llama"):
        engine = RefEngine(config(models[name], world_size))
        chunk = engine.model_chunks[-1]
        mb = engine.micro_batches(ragged_batch(3), max_samples=None, max_tokens=None)[0]
        seen = []
        hook = chunk.decoder.final_layernorm.register_forward_hook(lambda module, args, output: seen.append(output))
        plain = GPTModel(engine.transformer_config, layer_spec(engine.weight_map.arch, False),
                         **gpt_model_kwargs(engine.weight_map.arch, engine.vocab_rows)).to(engine.params_dtype)
        plain.load_state_dict(chunk.state_dict(), strict=True)
        with torch.no_grad():
            hidden = chunk(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None)
            hook.remove()
            logits = plain(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None)
        out[name] = {"hidden": hidden, "final_norm": seen[0], "logits": logits,
                     "output_weight": engine.output_weight().detach().clone()}
        del engine
        reset_layout()
    return out
