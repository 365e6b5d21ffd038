"""Routed experts (routing replay, "R3"): which experts each token was routed to at generation.

SGLang 0.5.23's contract, followed by the CPU engine and read by the client:
- the server runs with `--enable-return-routed-experts` (`srt/arg_groups/fields/exec_.py`:
  `enable_return_routed_experts`); without it no routes are returned;
- a `/generate` request asks with `return_routed_experts: true` and may give
  `routed_experts_start_len` (`srt/managers/io_struct.py`: `GenerateReqInput`), an absolute
  position in [0, prompt tokens] (the scheduler aborts the request otherwise:
  `srt/managers/scheduler.py`, `handle_generate_request`);
- the answer's `meta_info["routed_experts"]` is base64 of int32 (`srt/managers/detokenizer_manager.py`:
  `_b64_encode_per_request`; decoded by `srt/state_capturer/routed_experts.py`:
  `extract_routed_experts_from_meta_info`), shape (tokens, num_hidden_layers, num_experts_per_tok)
  in C order, rows for the sequence positions [start_len, prompt + output - 1)
  (`srt/managers/scheduler_components/batch_result_processor.py`: `_maybe_collect_routed_experts`,
  `srt/state_capturer/base.py`: `get_topk`): every token that went through the model as an input,
  prompt included; the last output token is sampled but never fed in, so it has no row.
The wire stays SGLang's int32; the client narrows the decoded routes (`narrow_routes`). The CPU
engine records the routes with hooks on its model's routers (`rollout.cpu.route_recorder`).
"""
from __future__ import annotations

import base64

import numpy as np
import torch

from megarl.rollout.launch import ROUTED_EXPERTS_FLAG as SERVER_FLAG  # noqa: F401 (the server flag)


def encode_routed_experts(routes: torch.Tensor) -> str:
    """(tokens, layers, top_k) integer tensor -> SGLang's base64 of its int32 bytes (C order)."""
    return base64.b64encode(routes.to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")


def decode_routed_experts(encoded: str, tokens: int) -> torch.Tensor:
    """SGLang's base64 string -> int32 tensor (tokens, layers * top_k); the caller knows `tokens`
    (prompt + output - 1 - start_len) and splits the rest into (layers, top_k)."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    if tokens == 0 or flat.size % tokens:
        raise ValueError(f"routed_experts holds {flat.size} int32 values, not a multiple of {tokens} tokens")
    return torch.from_numpy(flat.copy()).reshape(tokens, -1)


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer dtype megarl holds routes in (batch memory, Ray transfers): uint8 up
    to 256 experts; beyond, int16, then int32 (torch 2.13's uint16 tensors do not pickle, so Ray
    could not carry them). At Qwen3-30B-A3B scale (48 layers x top-8) uint8 is 384 bytes a token
    where SGLang's int32 is 1536."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


def narrow_routes(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Decoded routes (SGLang's int32) in `route_dtype(num_experts)`; every expert index must be
    in [0, num_experts) (else the server runs another model)."""
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= num_experts):
        raise ValueError(f"routed_experts holds expert indices in [{int(routes.min())}, {int(routes.max())}], "
                         f"outside [0, {num_experts}) of the actor's model")
    return routes.to(route_dtype(num_experts))
