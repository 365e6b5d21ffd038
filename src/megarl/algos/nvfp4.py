"""NVFP4 fake quantization of a weight (quantization-aware training, verl's `megatron.qat` W4A16).

`nvfp4_fake_quant(weight)` returns the weight quantized to NVFP4 and dequantized back to its dtype,
the values NVIDIA ModelOpt's NVFP4 gives (modelopt 0.47.0, torch/quantization/qtensor/nvfp4_tensor.py
`NVFP4QTensor.quantize` then `.dequantize`), with a straight-through gradient (ModelOpt's dynamic
block quantizer's backward, tensor_quant.py `DynamicBlockQuantizationFunction.backward`: the
gradient passes unchanged, none of a weight lies beyond its own amax). For `weight` [..., in] in
groups of `group_size` (16) along `in`:

    global_scale = amax(|weight|) / (6 * 448)                               fp32, one per tensor
    block_scale  = e4m3(clamp(amax(|group|) / (6 * global_scale), 2^-9, 448))   (0 -> 1 first)
    value        = e2m1(weight / (block_scale * global_scale)) * block_scale * global_scale

e2m1 rounds |x| to the nearest of {0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to the even code (0.25 -> 0,
0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), beyond 6 to 6, sign kept.
An all-zero weight stays zero (ModelOpt's export divides 0 by 0 there).

ModelOpt's training kernel on Hopper (kernels/quantization/gemm/fp4_kernel_hopper.py
`fp4_fake_quant_block`, what verl trains through on GPUs) differs from this, its export format,
only for groups whose amax is below 2^-10 x 448 x global_scale (it rounds their scale to 0 and the
group to 0; the export clamps it to 2^-9) or whose scale is below 1e-5 (it uses 1.0): verl serves
the export's values, and megarl trains and serves the same values.
"""
from __future__ import annotations

import torch

from megarl.config.rules.qat import NVFP4_GROUP as GROUP_SIZE  # NVFP4's group: one FP8 scale per 16 FP4 weights

E2M1_MAX = 6.0
E4M3_MAX = 448.0
# the attribute marking a parameter that a QAT forward fake-quantizes: its group size
# (set by megarl.engines.megatron.qat, read by the weight push, megarl.sync.resharder)
PARAM_MARK = "nvfp4_group_size"


def _round_e2m1(magnitude: torch.Tensor) -> torch.Tensor:
    """|x| (fp32, >= 0) rounded to the e2m1 grid, ties to even, saturating at 6."""
    return torch.where(magnitude <= 0.25, 0.0,
           torch.where(magnitude < 0.75, 0.5,
           torch.where(magnitude <= 1.25, 1.0,
           torch.where(magnitude < 1.75, 1.5,
           torch.where(magnitude <= 2.5, 2.0,
           torch.where(magnitude < 3.5, 3.0,
           torch.where(magnitude <= 5.0, 4.0, 6.0)))))))


def nvfp4_dequantized(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """`weight` [..., in] (in divisible by `group_size`) through NVFP4 and back, same shape and dtype;
    no gradient."""
    if weight.shape[-1] % group_size:
        raise ValueError(f"NVFP4: the weight's last dimension {weight.shape[-1]} is not a multiple of "
                         f"the group size {group_size}")
    with torch.no_grad():
        amax = weight.abs().max().float()
        if amax == 0:
            return torch.zeros_like(weight)
        global_scale = amax / (E2M1_MAX * E4M3_MAX)
        groups = weight.reshape(*weight.shape[:-1], -1, group_size)
        group_amax = groups.abs().amax(-1).float()
        block_scale = group_amax / (E2M1_MAX * global_scale)
        block_scale[block_scale == 0] = 1.0
        block_scale = block_scale.clamp(min=2 ** -9, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        scale = (block_scale * global_scale).unsqueeze(-1)  # [..., groups, 1] fp32
        scaled = groups / scale
        magnitude = _round_e2m1(scaled.abs())
        values = torch.where(scaled < 0, -magnitude, magnitude) * scale + 0.0  # + 0.0: -0 -> +0, as ModelOpt's
        return values.reshape(weight.shape).to(weight.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, group_size: int) -> torch.Tensor:
        return nvfp4_dequantized(weight, group_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def nvfp4_fake_quant(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """`nvfp4_dequantized(weight)` with the gradient passed straight through to `weight`."""
    return _StraightThrough.apply(weight, group_size)
