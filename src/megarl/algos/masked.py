"""Masked reductions over per-token tensors.

`x` and `mask` are `[batch, response_len]`; `mask` is 1 for a real response token and 0 for
padding (any dtype). Padding is excluded exactly: it is selected away with `torch.where`, so a
NaN or inf in a padded position never reaches a result. A reduction over no valid element
returns 0, never NaN.
"""
from __future__ import annotations

from typing import Optional

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of `x` over the valid positions (all of them, or along `dim`)."""
    selected = torch.where(mask.bool(), x, 0.0)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_count(mask: torch.Tensor, dim: Optional[int] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Number of valid positions (all of them, or along `dim`) as a `dtype` tensor."""
    valid = mask.bool().to(dtype)
    return valid.sum() if dim is None else valid.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of `x` over the valid positions; 0 where there is none."""
    count = masked_count(mask, dim, dtype=x.dtype)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all valid positions (two-pass; Bessel-corrected when `unbiased`).

    Fewer than two valid positions (one for the biased form) give 0.
    """
    count = masked_count(mask, dtype=x.dtype)
    mean = masked_sum(x, mask) / count.clamp(min=1)
    squared = masked_sum((x - mean) ** 2, mask)
    dof = count - 1 if unbiased else count
    return torch.where(dof > 0, squared / dof.clamp(min=1), torch.zeros_like(squared))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased variance over all valid positions of the
    batch; padded positions of the result are 0."""
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return torch.where(mask.bool(), whitened, 0.0)
