"""The oracles of the block-FP8 tests (tests/rollout/test_fp8*.py, tests/sglang/test_fp8_oracle.py,
tests/sync/test_fp8_push.py): transformers 5.25's own FP8 quantizer and dequantizer
(`integrations/finegrained_fp8.py::Fp8Quantize._quantize_one`, `Fp8Dequantize._dequantize_one`), and
the test weights."""
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize


class _Quantizer:
    """What transformers' FP8 ops read of their quantizer: the config's block size and scale format."""

    class quantization_config:  # noqa: N801 (an attribute standing for transformers' config object)
        weight_block_size = [128, 128]
        scale_fmt = None


def transformers_quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = Fp8Quantize(_Quantizer())._quantize_one("w.weight", weight)
    return out["w.weight"], out["w.weight_scale_inv"]


def transformers_dequantize(values, scale_inv, dtype) -> torch.Tensor:
    return Fp8Dequantize(_Quantizer())._dequantize_one(values, scale_inv, output_dtype=dtype)


def weight(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Random weights with a zero block, a block of large values and one of tiny ones."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[:128, :128] = 0.0
    if shape[0] > 128:
        w[128:256, :128] *= 5000.0  # amax ~ 400: scales near 1
    if shape[1] > 128:
        w[:128, 128:256] *= 1e-3
    return w.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
