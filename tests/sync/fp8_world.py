"""The body of tests/sync/test_fp8_push.py: a 2-rank gloo world of real megatron-core (CPU shims on) that
pushes block-FP8 weights (`SyncConfig.fp8_weights`) into CPU engines serving FP8 checkpoints: a dense
model at TP 2 through the distributed, tensor and disk transports (one server each, an update before
each push), then an MoE at EP 2 (each EP rank emits its own experts) through the distributed one. Every
push runs with `check_weights` (the servers' checksums of values and scales against the emitters').
Each rank returns its chunks' state after each push, for the test to merge into the actor's HF weights."""
from __future__ import annotations

from pathlib import Path

import torch

from megarl.bridge import ParallelLayout
from megarl.sync import SyncConfig, WeightSync
from megarl.testing import init_gloo_model_parallel
from sync_world import _ps, build_chunks, load_hf, perturb, reinit_experts, weight_map

DIVISIBLE_BY = 8


def chunk_states(chunks: list, layout: ParallelLayout) -> dict:
    """{layout key of this rank: its chunk's state dict (copies)}, as `bridge.merge_model` takes them."""
    ps = _ps()
    key = layout.key(ps.get_pipeline_model_parallel_rank(), 0, ps.get_tensor_model_parallel_rank(),
                     ps.get_expert_model_parallel_rank())
    (chunk,) = chunks
    return {key: {k: v.detach().clone() for k, v in chunk.state_dict().items() if "_extra_state" not in k}}


def push(chunks, weights, url: str, transport: str, case: dict, fp8_dir: str, quantized: frozenset) -> dict:
    paths = dict(disk_dir=case["disk_dir"], hf_assets_dir=fp8_dir) if transport == "disk" else {}
    sync = WeightSync(chunks, weights, [url], SyncConfig(
        transport=transport, backend="gloo", bucket_bytes=case["bucket_bytes"], check_weights=True, timeout_s=60,
        fp8_weights=quantized, **paths))
    try:
        return sync.push()
    finally:
        sync.close()


def fp8_world(rank: int, world_size: int, port: int, dense: dict, moe: dict) -> dict:
    from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims
    from megarl.engines.megatron.cpu.shims import apply_cpu_shims

    init_gloo_model_parallel(rank, world_size, port, tp=2, timeout_s=300)
    apply_moe_cpu_shims()
    out = {"dense": []}
    layout = ParallelLayout(2, 1)
    weights = weight_map(Path(dense["hf_dir"]), 2, DIVISIBLE_BY)
    chunks = build_chunks(weights, layout, torch.float32)
    load_hf(chunks, weights, layout, Path(dense["hf_dir"]))
    for k, (transport, url) in enumerate(dense["servers"]):
        perturb(chunks, weights, seed=k + 1)
        metrics = push(chunks, weights, url, transport, dense, dense["fp8_dir"], dense["quantized"])
        out["dense"].append(dict(transport=transport, metrics=metrics, state=chunk_states(chunks, layout)))
    layout = ParallelLayout(tp=1, pp=1, ep=2, etp=1)
    reinit_experts(layout)
    weights = weight_map(Path(moe["hf_dir"]), 1, DIVISIBLE_BY)
    chunks = build_chunks(weights, layout, torch.float32)
    apply_cpu_shims()  # reach the MoE modules imported by the build
    load_hf(chunks, weights, layout, Path(moe["hf_dir"]))
    metrics = push(chunks, weights, moe["url"], "distributed", moe, moe["fp8_dir"], moe["quantized"])
    out["moe"] = dict(metrics=metrics, state=chunk_states(chunks, layout))
    return out
