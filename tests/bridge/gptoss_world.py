"""The body of the gpt-oss bridge checks: 4 gloo processes running real megatron-core
layers (CPU). For each layout the bridge-converted `torch_dist` checkpoint is loaded with the
engine's loader into `GPTModel` chunks built twice, once with megatron's own local attention
(`DotProductAttention`: `SoftmaxOne` sinks, `FusedScaleMaskSoftmax` windows) and once with megarl's
`CpuReferenceAttention` (the engine's attention on CPU); each rank asserts that its state dict is
the pure `shard_model` output, runs a forward pass (logits returned by the reporting rank), doubles
every weight and saves with the engine's checkpoint writer, for the test to export. At each layout,
and at TP1 x EP1 (DP4), the weight push's resharder runs on the loaded chunks (`pushed`): what its
emitters would send. Negative controls zero the sinks or drop the windows.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from megarl.bridge import shard_model
from megarl.bridge.megatron_config import gpt_model_kwargs, layer_spec, set_yarn_attributes, transformer_config_kwargs
from megarl.engines.megatron.checkpoint_io import load_torch_dist_weights, save_checkpoint
from megarl.engines.megatron.cp_attention import cpu_reference_attention, with_core_attention
from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims
from megarl.engines.megatron.cpu.shims import apply_cpu_shims
from megarl.testing import init_gloo_model_parallel
from megatron_world import forward_logits, full_tensors, local_state, read_hf
from moe_world import _assert_loaded, _double, _reinit, layout_of, rank_key, saved_dir, weights_for

# (tp, pp, ep, etp); etp 0 means etp = tp. Expert biases need ETP 1 (megatron-core), so TP2 runs with EP2 x ETP1.
LAYOUTS = [(1, 1, 2, 0), (2, 1, 2, 1), (1, 2, 2, 0)]
PUSH_LAYOUTS = LAYOUTS + [(1, 1, 1, 0)]  # the push also at EP1 (expert TP must be 1: TP1)
PUSH_BUCKET_BYTES = 16 * 2**10  # below one layer's experts (8 x 3 x [64 x 40] fp32 = 240 KiB): they stay together
ATTENTIONS = ("megatron_local", "cpu_reference")


def build(weights, layout, attention: str) -> list:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = set_yarn_attributes(TransformerConfig(**transformer_config_kwargs(weights.arch, layout),
                                                   use_cpu_initialization=True, perform_initialization=False),
                                 weights.arch)
    spec = layer_spec(weights.arch)
    if attention == "cpu_reference":
        spec = with_core_attention(spec, cpu_reference_attention())
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunk = GPTModel(config, spec, **gpt_model_kwargs(weights.arch, weights.padded_vocab_size),
                     pre_process=layout.is_first(pp_rank, 0), post_process=layout.is_last(pp_rank, 0)).eval()
    expected = "CpuReferenceAttention" if attention == "cpu_reference" else "DotProductAttention"
    assert {type(layer.self_attention.core_attention).__name__ for layer in chunk.decoder.layers} == {expected}
    apply_cpu_shims()
    return [chunk]


def push_tensors(chunks: list, weights) -> dict:
    """What this rank's weight-push resharder emits: {HF name: tensor}, its bucket numbers, its roles."""
    from megarl.bridge.fused_experts import fuses_experts
    from megarl.sync.groups import ParallelGroups
    from megarl.sync.resharder import Resharder

    groups = ParallelGroups.from_parallel_state(fused_experts=fuses_experts(weights.arch))
    tensors, buckets = {}, []
    for bucket in Resharder(chunks, weights, groups, PUSH_BUCKET_BYTES).buckets():
        buckets.append((bucket.index, bucket.count, [name for name, _ in bucket.named_tensors()]))
        for name, tensor in bucket.named_tensors():
            assert name not in tensors, name
            tensors[name] = tensor.clone()
    return dict(tensors=tensors, buckets=buckets, pp_rank=groups.pp_rank, ep_rank=groups.ep_rank,
                emits_experts=groups.emits_experts, emitter=groups.is_emitter)


def world(rank: int, world_size: int, port: int, case: dict, out_dir: str) -> dict:
    from megatron.core import parallel_state as ps

    init_gloo_model_parallel(rank, world_size, port)
    apply_moe_cpu_shims()
    started = time.monotonic()
    result = {"state_dicts": {}, "logit_diffs": {}, "negative_diffs": {}, "seconds": {}, "pushed": {}}
    hf = read_hf(case["hf_dir"])
    vocab = case["hf_logits"].shape[-1]
    for t in LAYOUTS:
        layout = layout_of(t)
        _reinit(layout)
        weights = weights_for(case["hf_dir"], layout.tp)
        full = full_tensors(weights, hf)
        for attention in ATTENTIONS:
            chunks = build(weights, layout, attention)
            load_torch_dist_weights(chunks, case["ckpt_dir"])  # the bridge-converted checkpoint
            _assert_loaded(chunks, weights, full, layout, f"{attention} at {layout}")
            logits = forward_logits(chunks, case["input_ids"])
            if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
                result["logit_diffs"][(t, attention)] = (logits[..., :vocab] - case["hf_logits"]).abs().max().item()
        result["state_dicts"][(t, rank_key(layout))] = local_state(chunks[0])
        result["pushed"][(t, rank)] = push_tensors(chunks, weights)
        _double(chunks)
        save_checkpoint(saved_dir(out_dir, "gpt_oss", t), chunks, None, None, 0, False)
        result["seconds"][str(t)] = round(time.monotonic() - started, 1)

    for t in PUSH_LAYOUTS[len(LAYOUTS):]:
        layout = layout_of(t)
        _reinit(layout)
        weights = weights_for(case["hf_dir"], layout.tp)
        chunks = build(weights, layout, "cpu_reference")
        load_torch_dist_weights(chunks, case["ckpt_dir"])
        result["pushed"][(t, rank)] = push_tensors(chunks, weights)

    # negative controls at TP1 x EP2 (the CPU engine's attention): each drops one feature the logits test must see
    layout = layout_of(LAYOUTS[0])
    _reinit(layout)
    weights = weights_for(case["hf_dir"], 1)
    shards = shard_model(weights, full_tensors(weights, hf), layout)[rank_key(layout)]
    no_window = dataclasses.replace(weights, arch=dataclasses.replace(weights.arch, sliding_window=None,
                                                                      window_layers=None))
    controls = {"zero_sinks": (weights, {k: (torch.zeros_like(v) if k.endswith("softmax_offset") else v)
                                         for k, v in shards.items()}),
                "no_windows": (no_window, shards)}
    for control, (control_weights, sd) in controls.items():
        chunks = build(control_weights, layout, "cpu_reference")
        chunks[0].load_state_dict({**chunks[0].state_dict(), **sd}, strict=True)
        logits = forward_logits(chunks, case["input_ids"])
        result["negative_diffs"][control] = (logits[..., :vocab] - case["hf_logits"]).abs().max().item()
    return result
