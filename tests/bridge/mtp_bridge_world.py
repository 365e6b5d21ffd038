"""The body of the multi-token-prediction bridge check: one gloo process builds real megatron-core
`GPTModel(mtp_block_spec=...)` for a tiny DeepSeek-V3 (multi-latent attention, a dense then an MoE layer,
one MTP layer; local spec, megarl's CPU core attention), loads every parameter from the HF tensors through
`WeightMap(mtp=True)`, and returns its parameter names and the hidden states megatron's MTP block hands
to the output layer (the main model's and the MTP layer's), for the test to check against HF."""
from __future__ import annotations

import torch

from megarl.bridge import WeightMap, arch_from_hf_config
from megarl.bridge.megatron_config import (block_spec, config_class, gpt_model_kwargs, layer_spec,
                                           transformer_config_kwargs)
from megarl.bridge.sharding import ParallelLayout
from megarl.engines.megatron.cp_attention import cpu_reference_attention, with_core_attention
from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims
from megarl.engines.megatron.cpu.shims import apply_cpu_shims
from megarl.testing import init_gloo_model_parallel


def build(weights: WeightMap):
    """The tiny model with its MTP block (megatron-core gpt_layer_specs.py `get_gpt_mtp_block_spec`: the MTP
    layer's transformer layer is the decoder's last layer spec, here the MoE one)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    arch, layout = weights.arch, ParallelLayout()
    config = config_class(arch)(**transformer_config_kwargs(arch, layout), mtp_num_layers=arch.mtp_layers,
                                use_cpu_initialization=True, perform_initialization=False)
    attention = cpu_reference_attention()
    moe_spec, dense_spec = (with_core_attention(layer_spec(arch, dense=d), attention) for d in (False, True))
    return GPTModel(config, block_spec(arch, layout, 0, 0, moe_spec, dense_spec),
                    **gpt_model_kwargs(arch, weights.padded_vocab_size), pre_process=True, post_process=True,
                    mtp_block_spec=get_gpt_mtp_block_spec(config, moe_spec, use_transformer_engine=False)).eval()


def world(rank: int, world_size: int, port: int, hf_config: dict, hf: dict, padded_vocab: int,
          input_ids: torch.Tensor) -> dict:
    init_gloo_model_parallel(rank, world_size, port)
    apply_moe_cpu_shims()
    weights = WeightMap(arch_from_hf_config(hf_config), padded_vocab, mtp=True)
    model = build(weights)
    apply_cpu_shims()
    held = {**dict(model.named_parameters()),
            **{n: b for n, b in model.named_buffers() if n.endswith("mlp.router.expert_bias")}}
    with torch.no_grad():
        for name, tensor in held.items():
            tensor.copy_(weights.to_mcore(weights.canonical(name), hf.__getitem__))
    captured = {}
    model.mtp.register_forward_hook(lambda module, args, out: captured.setdefault("mtp", out.detach().clone()))
    b, s = input_ids.shape
    with torch.no_grad():  # labels: megatron-core 0.16 runs its MTP block only with them (gpt_model.py _postprocess)
        model(input_ids=input_ids, position_ids=torch.arange(s).expand(b, -1), attention_mask=None,
              labels=input_ids)
    main, mtp = torch.chunk(captured["mtp"], 1 + weights.arch.mtp_layers, dim=0)  # [s, b, H] each
    output = model.output_layer.weight.detach()
    return {"names": sorted(weights.canonical(n) for n in held),
            "main_logits": (main.transpose(0, 1) @ output.T)[..., :weights.arch.vocab_size],
            "mtp_logits": (mtp.transpose(0, 1) @ output.T)[..., :weights.arch.vocab_size]}


def keys_world(rank: int, world_size: int, port: int, hf_configs: dict, padded_vocab: int) -> dict:
    """{family: (the keys a real megatron `GPTModel` with its MTP block saves, `sharded_keys`; the keys of the
    engine's checkpoint request for it, `model_sharded_state_dict`)} for each HF config."""
    from megarl.engines.megatron.checkpoint_io import model_sharded_state_dict
    from megatron_world import sharded_keys

    init_gloo_model_parallel(rank, world_size, port)
    apply_moe_cpu_shims()
    out = {}
    for family, hf_config in hf_configs.items():
        model = build(WeightMap(arch_from_hf_config(hf_config), padded_vocab, mtp=True))
        out[family] = (sharded_keys(model.sharded_state_dict()), sharded_keys(model_sharded_state_dict([model])["model"]))
    return out
