"""SGLang 0.5.23's `/weights_checker` "checksum" action: its request and answer, which megarl's CPU
engine serves, and the hash both sides use (the trainer hashes what it pushed).

Request (`CheckWeightsReqInput`, sglang/srt/managers/io_struct.py): `action` ("checksum"; SGLang
also has "snapshot", "reset_tensors", "compare", which the CPU engine refuses), `allow_quant_error`,
`skip_tensor_list` (name substrings to leave out), `selector` ("target", "draft", "all").
Response (http_server.py `check_weights`): `{"success", "message", "ranks", "per_engine_checksum"}`;
`ranks` holds one `ChecksumInfo` per TP rank: `{"checksums": {name: 16 hex digits},
"per_gpu_checksum", "parallelism_info": [ParallelismInfo, one per runner role]}`. A refused
request answers HTTP 400 with `success` false.

The per-tensor hash is SGLang's `tensor_hash` CPU path (sglang/srt/managers/mm_utils.py): sha256 of
the tensor's bytes (contiguous, row-major), its first 8 bytes read big-endian, written as 16 hex
digits (`utils/weight_checker.py` `_hash_tensor`). SGLang hashes a CUDA tensor with a Triton kernel
instead, so only CPU-resident tensors hash alike. The tensors hashed are the model's parameters and
buffers, less its non-persistent buffers (`_NON_PERSISTENT_BUFFER_PATTERNS`: rotary caches), named
as the model names them: for the CPU engine, a transformers model, the HF checkpoint names (a tied
output layer appears once, as the embedding; fused MoE experts appear per expert:
`rollout.cpu.checkpoint_names.model_tensors`). Real SGLang names its own fused, TP-sharded parameters
(`qkv_proj`, `gate_up_proj`), which is why megarl compares per-tensor checksums with the CPU engine
only (config rule `weight_check_needs_cpu_engine`).
"""
from __future__ import annotations

import hashlib
from typing import Iterable, Literal, Optional

import torch
from pydantic import BaseModel

NON_PERSISTENT_BUFFER_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")


class CheckWeightsReq(BaseModel):
    """SGLang 0.5.23 `CheckWeightsReqInput`, HTTP form."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: Optional[list[str]] = None
    selector: Literal["target", "draft", "all"] = "all"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """16 hex digits: the first 8 bytes of sha256 over the tensor's bytes (SGLang's CPU `tensor_hash`)."""
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return f"{int.from_bytes(hashlib.sha256(memoryview(data.numpy())).digest()[:8], 'big'):016x}"


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's `overall_checksum`: sha256 over the sorted (name, checksum) pairs."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def checksum_response(named_tensors: Iterable[tuple[str, torch.Tensor]],
                      skip_tensor_list: Optional[list[str]] = None) -> dict:
    """The whole `/weights_checker` answer of a server with one TP rank and no draft model."""
    skip = tuple(NON_PERSISTENT_BUFFER_PATTERNS) + tuple(skip_tensor_list or ())
    checksums = {name: tensor_checksum(t) for name, t in named_tensors if not any(p in name for p in skip)}
    per_gpu = overall_checksum(checksums)
    placement = dict(role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
    return {
        "success": True,
        "message": "Success.",
        "ranks": [{"checksums": checksums, "per_gpu_checksum": per_gpu, "parallelism_info": [placement]}],
        "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
    }
