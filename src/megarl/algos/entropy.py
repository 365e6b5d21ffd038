"""Per-token entropy of the policy's next-token distribution, from logits (nats).

`entropy_from_logits(logits)` works on full-vocabulary logits `[..., vocab]`.
`vocab_parallel_entropy_partial` works on one tensor-parallel shard of the vocabulary: with the
log-sum-exp over the whole vocabulary already reduced across shards, each shard's partial
entropies sum (all-reduce SUM) to the full entropy. The reductions are the caller's; shifting
the logits by the global maximum first keeps float32 accurate for large logits:

    m       = all_reduce(shard.amax(-1), MAX)                       # [...]
    shifted = shard - m[..., None]
    lse     = log(all_reduce(exp(shifted).sum(-1), SUM))            # log-sum-exp of `shifted`
    H       = all_reduce(vocab_parallel_entropy_partial(shifted, lse), SUM)

Both compute in float32 (float64 stays float64); entries with probability 0 (logit -inf)
contribute exactly 0, to the value and to the gradient.
"""
from __future__ import annotations

import torch


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype == torch.float64 else logits.float()


def vocab_parallel_entropy_partial(logits_shard: torch.Tensor, logsumexp: torch.Tensor) -> torch.Tensor:
    """sum over this shard's vocabulary entries v of p_v * (lse - z_v), where p_v = exp(z_v - lse).

    `logits_shard` is `[..., vocab_shard]`, `logsumexp` the full-vocabulary log-sum-exp `[...]`.
    """
    z = _upcast(logits_shard)
    lse = logsumexp.to(z.dtype)[..., None]
    prob = torch.exp(z - lse)
    # Where prob is 0 (z = -inf), use z = lse so that 0 * inf never appears, not even in the backward.
    surprisal = lse - torch.where(prob > 0, z, lse)
    return (prob * surprisal).sum(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v with p = softmax(logits), for logits shifted by their maximum (H does
    not change) so the log-sum-exp stays small and exact; `[..., vocab]` -> `[...]`."""
    z = _upcast(logits)
    z = z - z.amax(dim=-1, keepdim=True).detach()
    return vocab_parallel_entropy_partial(z, torch.logsumexp(z, dim=-1))
