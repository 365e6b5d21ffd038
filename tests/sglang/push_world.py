"""The actor side of test_weight_push.py: one gloo rank running real megatron-core (TP 1, PP 1) that
pushes HF checkpoints into a real SGLang server through `WeightSync`, once per transport, and
records what the server answers after each push (its greedy samples through `RolloutClient`, its
`/model_info` version). The test holds the samples to HF transformers' log-probs of the checkpoints.

Pushes, in order (each changes the weights the server holds):
    tensor       checkpoint B  (colocated layout: per-TP-rank copies relayed through `IpcRelay`,
                                /update_weights_from_tensor, load_format null, shared memory)
    distributed  checkpoint C  (gloo weight-update group, /update_weights_from_distributed, flattened_bucket)
    disk         checkpoint B  (/update_weights_from_disk)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sync"))  # the weight sync's test helpers

from sync_world import build_chunks, load_hf, server_samples, weight_map  # noqa: E402

from megarl.bridge import ParallelLayout  # noqa: E402
from megarl.rollout.control import ServerControl, ServerError  # noqa: E402
from megarl.sync import SyncConfig, WeightSync  # noqa: E402
from megarl.testing import init_gloo_model_parallel  # noqa: E402

BUCKET_BYTES = 200 * 1024  # several buckets for the ~1.2 MB tiny Qwen2: several requests, then the commit
PUSHES = (("tensor", "B"), ("distributed", "C"), ("disk", "B"))


def sync_config(transport: str, disk_dir: str, hf_assets_dir: str) -> SyncConfig:
    if transport == "distributed":
        return SyncConfig(transport="distributed", backend="gloo", bucket_bytes=BUCKET_BYTES, timeout_s=120,
                          group_timeout_s=120)
    if transport == "disk":
        return SyncConfig(transport="disk", bucket_bytes=BUCKET_BYTES, disk_dir=disk_dir, hf_assets_dir=hf_assets_dir,
                          timeout_s=120)
    return SyncConfig(transport="tensor", bucket_bytes=BUCKET_BYTES, timeout_s=120, group_timeout_s=120)


def push_story(rank: int, world_size: int, port: int, url: str, checkpoints: dict, disk_dir: str) -> dict:
    """{transport: what the server answered after that push}; `checkpoints`: {"B": dir, "C": dir}."""
    init_gloo_model_parallel(rank, world_size, port)
    layout = ParallelLayout()
    weights = weight_map(Path(checkpoints["B"]), 1, 64)
    chunks = build_chunks(weights, layout, torch.float32)
    server = ServerControl(url, timeout_s=60)
    out, version = {}, 0
    for transport, name in PUSHES:
        load_hf(chunks, weights, layout, Path(checkpoints[name]))
        sync = WeightSync(chunks, weights, [url], sync_config(transport, disk_dir, checkpoints[name]),
                          initial_version=version)
        metrics = sync.push()
        version = sync.version
        record = dict(checkpoint=name, version=version, buckets=metrics["sync/buckets"],
                      samples=server_samples(url), model_info_version=server.weight_version())
        if transport == "tensor":
            record["peers"] = sync.transport.peers  # per-TP-rank copies: the colocated layout
        if transport == "distributed":
            record["group"] = sync.transport.group_name
        sync.close()
        if transport == "distributed":  # close() destroyed the server's end: a second destroy is refused
            try:
                server.destroy_weights_update_group(record["group"])
                record["destroy_again"] = None
            except ServerError as e:
                record["destroy_again"] = str(e)
        out[transport] = record
    return out


def push_one(rank: int, world_size: int, port: int, url: str, checkpoint: str, transport: str, disk_dir: str) -> list:
    """One push of `checkpoint` (an MoE one too) through `WeightSync` over `transport`; the server's greedy
    samples after it."""
    from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims

    init_gloo_model_parallel(rank, world_size, port)
    apply_moe_cpu_shims()
    layout = ParallelLayout()
    weights = weight_map(Path(checkpoint), 1, 64)
    chunks = build_chunks(weights, layout, torch.float32)
    load_hf(chunks, weights, layout, Path(checkpoint))
    sync = WeightSync(chunks, weights, [url], sync_config(transport, disk_dir, checkpoint))
    sync.push()
    sync.close()
    return server_samples(url)
