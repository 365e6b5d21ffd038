"""The rollout servers' initial checkpoint with `actor_rollout_ref.rollout.quantization=fp8`: the HF
model's weights in block FP8 (`megarl.rollout.fp8`), written by megarl before the servers start (SGLang
reads the format from config.json, so the servers need no flag of their own). Every later push
quantizes the actor's weights by the same plan (`SyncConfig.fp8_weights`)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

from megarl.bridge import load_hf_config
from megarl.bridge.convert import copy_hf_assets
from megarl.bridge.output_dir import atomic_output_dir
from megarl.bridge.safetensors_io import HFCheckpointReader, ShardedSafetensorsWriter
from megarl.rollout import fp8

log = logging.getLogger("megarl.sync")

MAX_SHARD_BYTES = 4 * 2**30  # bytes per safetensors file of the written checkpoint


def fp8_plan_of(hf_dir: str | Path, tp_size: int = 1, ep_size: int = 1) -> fp8.Fp8Plan:
    """The FP8 plan of the HF checkpoint at `hf_dir` served at TP `tp_size`, EP `ep_size`
    (`fp8.plan`, from the tensors' headers and config.json's key/value heads)."""
    config = load_hf_config(hf_dir)
    kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    with HFCheckpointReader(hf_dir) as reader:
        shapes = {name: reader.shape(name) for name in reader.names()}
    return fp8.plan(shapes, tp_size, ep_size, kv_heads)


def write_fp8_checkpoint(hf_dir: str | Path, out: str | Path, plan: Optional[fp8.Fp8Plan] = None,
                         max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write `hf_dir`'s model to `out` (new, or empty) in block FP8: the weights of `plan.quantized` as
    e4m3 values and `weight_scale_inv`, every other tensor as it is, config.json with the
    `quantization_config` (its `ignored_layers` the plan's), the tokenizer and generation files
    copied. One tensor in memory at a time besides one output file's worth. `plan` None: `fp8_plan_of`
    at TP 1. Returns `out`."""
    hf_dir = Path(hf_dir)
    plan = plan or fp8_plan_of(hf_dir)
    with atomic_output_dir(out) as tmp:
        copy_hf_assets(hf_dir, tmp)
        config = load_hf_config(hf_dir)
        config["quantization_config"] = fp8.quantization_config(plan.ignored_layers)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        writer = ShardedSafetensorsWriter(tmp, max_shard_bytes)
        with HFCheckpointReader(hf_dir) as reader:
            missing = plan.quantized - set(reader.names())
            if missing:
                raise ValueError(f"{hf_dir}: the FP8 plan quantizes tensors the checkpoint lacks: "
                                 f"{sorted(missing)[:5]}")
            for name in reader.names():
                tensor = reader.read(name)
                if name in plan.quantized:
                    values, scale_inv = fp8.quantize(tensor)
                    writer.add(name, values)
                    writer.add(fp8.scale_name(name), scale_inv)
                else:
                    writer.add(name, tensor)
        writer.close()
    return Path(out)


def write_rollout_checkpoint(hf_dir: str | Path, out: str | Path, tp_size: int, ep_size: int = 1) -> fp8.Fp8Plan:
    """The servers' initial FP8 checkpoint of `hf_dir` at `out`, written again if it exists (a
    previous run's), for servers of TP `tp_size`, EP `ep_size`; returns its plan. The layers kept
    unquantized because SGLang would refuse their blocks are logged."""
    plan = fp8_plan_of(hf_dir, tp_size, ep_size)
    if plan.problems:
        log.warning("FP8 rollout: %d linear layers stay unquantized (listed in ignored_layers), as SGLang refuses "
                    "their 128 x 128 blocks at rollout TP %d: %s", len(plan.ignored_layers), tp_size,
                    "; ".join(plan.problems[:3]) + (" ..." if len(plan.problems) > 3 else ""))
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    write_fp8_checkpoint(hf_dir, out, plan)
    return plan
