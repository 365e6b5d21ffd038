"""The equality check of a push: did every server load exactly the HF tensors the actor sent?

Each emitter hashes the HF tensors of every bucket before it hands the bucket to its transport
(`bucket_checksums`, cast first to the servers' dtype, as a server casts what it loads, but block
FP8 values and scales, which it holds as sent: `rollout.fp8.held_as_sent`); after the
commit the coordinator asks every server for the checksums of what it holds (`/weights_checker`,
`SyncServer.weights_checksums`) and `mismatches` names each tensor and server that differ. The hash
is SGLang's (`rollout.weights_checker.tensor_checksum`). Servers must answer with one rank in HF
names: megarl's CPU engine (config rule `weight_check_needs_cpu_engine`).
"""
from __future__ import annotations

from typing import Optional

import torch

from megarl.rollout.fp8 import held_as_sent
from megarl.rollout.weights_checker import tensor_checksum
from megarl.sync.resharder import HFBucket

MAX_LISTED = 8  # mismatches named per server; the rest are counted


def server_dtype(name: str) -> torch.dtype:
    """`/server_info`'s "dtype" (e.g. "bfloat16") as a torch dtype."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"server dtype {name!r} is not a torch dtype")
    return dtype


def bucket_checksums(bucket: HFBucket, dtype: Optional[torch.dtype]) -> dict[str, str]:
    """{HF name: checksum} of the bucket's tensors, each cast to `dtype` (None, or FP8 values and scales: as sent)."""
    return {name: tensor_checksum(t if dtype is None or held_as_sent(name, t.dtype) else t.to(dtype))
            for name, t in bucket.named_tensors()}


def mismatches(url: str, sent: dict[str, str], ranks: list[dict[str, str]]) -> list[str]:
    """One message per tensor `sent` that the server at `url` does not hold bit for bit (none if equal).
    `ranks`: the server's checksums per TP rank; tensors the actor did not send are not compared."""
    if len(ranks) != 1:
        return [f"{url}: /weights_checker answered for {len(ranks)} TP ranks; the per-tensor check needs one "
                "rank holding whole HF-named tensors (megarl's CPU engine)"]
    held = ranks[0]
    problems = []
    for name in sorted(sent):
        if name not in held:
            problems.append(f"{url}: tensor {name} was sent but the server holds no tensor of that name")
        elif held[name] != sent[name]:
            problems.append(f"{url}: tensor {name}: the server holds checksum {held[name]}, the actor sent {sent[name]}")
    if len(problems) > MAX_LISTED:
        problems = problems[:MAX_LISTED] + [f"{url}: and {len(problems) - MAX_LISTED} more tensors differ"]
    return problems
