"""The body of the DeepSeek-V3 and GLM-4.5 bridge checks: gloo processes running real megatron-core
multi-latent attention (DeepSeek-V3) or grouped-query attention with partial rotary (GLM-4.5) and
sigmoid-routed MoE layers (local spec, megarl's CPU core attention, which takes MLA's separate key and
value head dims; megatron's local DotProductAttention does not).

For each case and layout, each rank builds its `GPTModel` chunk (dense first layers, then MoE layers: a
per-stage block spec), loads the bridge-converted `torch_dist` checkpoint with the engine's loader,
asserts that its state dict equals the pure `shard_model` output, runs a forward pass (logits returned
by the reporting rank), doubles every weight (exact in floating point) and saves with the engine's
checkpoint writer, so that the test can export what megatron wrote at that layout.
"""
from __future__ import annotations

import time

import torch

from megarl.bridge import ParallelLayout, WeightMap, shard_model
from megarl.bridge.megatron_config import block_spec, config_class, gpt_model_kwargs, layer_spec, transformer_config_kwargs
from megarl.engines.megatron.checkpoint_io import load_torch_dist_weights, model_sharded_state_dict, save_checkpoint
from megarl.engines.megatron.cp_attention import cpu_reference_attention, with_core_attention
from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims
from megarl.engines.megatron.cpu.shims import apply_cpu_shims
from megarl.testing import init_gloo_model_parallel
from megatron_world import forward_logits, full_tensors, local_state, read_hf, sharded_keys
from moe_world import _reinit, layout_of, rank_key, saved_dir, weights_for


def build(weights: WeightMap, layout: ParallelLayout) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    arch = weights.arch
    config = config_class(arch)(**transformer_config_kwargs(arch, layout), use_cpu_initialization=True,
                                perform_initialization=False)
    attention = cpu_reference_attention()
    moe_spec, dense_spec = (with_core_attention(layer_spec(arch, dense=d), attention) for d in (False, True))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunk = GPTModel(config, block_spec(arch, layout, pp_rank, 0, moe_spec, dense_spec),
                     **gpt_model_kwargs(arch, weights.padded_vocab_size),
                     pre_process=layout.is_first(pp_rank, 0), post_process=layout.is_last(pp_rank, 0)).eval()
    apply_cpu_shims()
    return [chunk]


def world(rank: int, world_size: int, port: int, cases: dict, layouts: list, out_dir: str) -> dict:
    """`cases`: {name: case}; results keyed (name, layout)."""

    init_gloo_model_parallel(rank, world_size, port)
    apply_moe_cpu_shims()
    started = time.monotonic()
    hf = {name: read_hf(case["hf_dir"]) for name, case in cases.items()}
    result = {"logit_diffs": {}, "seconds": {}, "sharded_keys": {}, "engine_keys": {}}
    _reinit(ParallelLayout())
    for name, case in cases.items():
        chunks = build(weights_for(case["hf_dir"], 1), ParallelLayout())
        result["sharded_keys"][name] = sharded_keys(chunks[0].sharded_state_dict())
        result["engine_keys"][name] = sharded_keys(model_sharded_state_dict(chunks)["model"])
    for t in layouts:
        layout = layout_of(t)
        _reinit(layout)
        for name, case in cases.items():
            _check_layout(name, case, hf[name], t, layout, result, out_dir)
        result["seconds"][str(t)] = round(time.monotonic() - started, 1)
    return result


def _check_layout(name: str, case: dict, hf: dict, t: tuple, layout: ParallelLayout, result: dict, out_dir: str):
    """Load case `name` at `layout`, check the shards, record its logits' distance to HF's, save it doubled."""
    from megatron.core import parallel_state as ps

    weights = weights_for(case["hf_dir"], layout.tp)
    chunks = build(weights, layout)
    load_torch_dist_weights(chunks, case["ckpt_dir"])
    got, want = local_state(chunks[0]), shard_model(weights, full_tensors(weights, hf), layout)[rank_key(layout)]
    assert got.keys() == want.keys(), f"{name} at {layout}: {sorted(got.keys() ^ want.keys())}"
    for param in want:
        assert torch.equal(got[param], want[param]), f"{name} at {layout}: {param} differs from the pure shard"
    logits = forward_logits(chunks, case["input_ids"])
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
        vocab = weights.arch.vocab_size
        result["logit_diffs"][(name, t)] = (logits[..., :vocab] - case["hf_logits"]).abs().max().item()
    with torch.no_grad():
        for tensor in chunks[0].state_dict().values():
            if isinstance(tensor, torch.Tensor):
                tensor.mul_(2)  # exact; the router's expert_bias buffer too
    save_checkpoint(saved_dir(out_dir, name, t), chunks, None, None, 0, False)
