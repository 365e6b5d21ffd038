"""Write the actor's live sharded weights as an HF checkpoint (after SFT, or at any checkpoint),
through the same resharder as the weight push: each emitter (a stage's, an EP rank's experts')
writes its own safetensors files in parallel (bucket numbers are unique within a stage); global rank 0 writes the index and copies the config and tokenizer.
Every rank of the model's world calls `export_hf`; the directory appears only when complete.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megarl.bridge import WeightMap
from megarl.bridge.convert import copy_hf_assets
from megarl.bridge.fused_experts import fuses_experts
from megarl.bridge.safetensors_io import save_safetensors
from megarl.sync.groups import ParallelGroups
from megarl.sync.resharder import Resharder

INDEX_FILE = "model.safetensors.index.json"


def export_hf(model_chunks: Sequence[torch.nn.Module], weights: WeightMap, out_dir: str | Path,
              hf_assets_dir: str | Path, bucket_bytes: int = 512 * 2**20, dtype: Optional[torch.dtype] = None) -> Path:
    """All ranks: write `out_dir` (config, tokenizer, sharded safetensors + index). Returns it."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    groups = ParallelGroups.from_parallel_state(fused_experts=fuses_experts(weights.arch))
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    written: dict[str, str] = {}
    total = 0
    for bucket in Resharder(model_chunks, weights, groups, bucket_bytes, dtype).buckets():
        file = f"model-pp{groups.pp_rank:03d}-{bucket.index:05d}.safetensors"
        tensors = {name: t.to("cpu", copy=True) for name, t in bucket.named_tensors()}
        save_safetensors(tensors, tmp / file)
        written.update({name: file for name in tensors})
        total += bucket.nbytes
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (written, total))
    if rank == 0:
        weight_map = {name: file for part, _ in parts for name, file in part.items()}
        index = {"metadata": {"total_size": sum(size for _, size in parts)}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        copy_hf_assets(Path(hf_assets_dir), tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    dist.barrier()
    return out
