"""megarl's stand-in for `sgl_kernel`, SGLang's compiled CPU kernels, when real SGLang 0.5.23 serves on
a CPU without AMX (on the server's PYTHONPATH only: `megarl.rollout.launch.sglang_server_env`).

PyPI's sgl-kernel / sglang-kernel wheels are CUDA builds with no source distribution, yet with
`SGLANG_USE_CPU_ENGINE=1` SGLang imports CPU kernels from `sgl_kernel` at module level
(`sglang/kernels/ops/kvcache/cache_move.py`, `sglang/srt/mem_cache/allocation.py`). Without AMX every
model layer takes SGLang's torch-native path, and the one kernel called is
`assign_req_to_token_pool_cpu` (every batch). That one is written here in torch; any other kernel
imports (so SGLang's module-level imports succeed) and raises NotImplementedError naming itself
when called, as a missing kernel would.
"""
import torch


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request i of the batch: `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`
    = the next `end_offset[i] - start_offset[i]` entries of `out_cache_loc` (KV-cache slots, in batch
    order), as SGLang's Triton kernel `assign_req_to_token_pool` (mem_cache/allocation.py) does.
    Shapes: req_pool_indices, start_offset, end_offset [batch]; req_to_token [pool rows, pool_len];
    out_cache_loc [sum of (end - start)]."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        if not 0 <= start <= end <= pool_len:
            raise IndexError(f"assign_req_to_token_pool_cpu: slots [{start}, {end}) outside a row of {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[taken:taken + end - start].to(req_to_token.dtype)
        taken += end - start
    if taken != out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {out_cache_loc.numel()} cache slots for {taken} tokens")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: megarl's CPU stand-in for sgl_kernel has no such kernel "
                                  "(only assign_req_to_token_pool_cpu, the one SGLang calls on a CPU without AMX)")

    missing.__name__ = name
    return missing
