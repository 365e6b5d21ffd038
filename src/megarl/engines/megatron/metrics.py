"""A mini-batch's training metrics from its micro-batches on every data-parallel rank.

Each micro-batch's loss head reports `megarl.algos.metrics.Metrics`, every value declared with its
`Reduction`; `reduce_over_micro_batches` combines them by that declaration. The values are
summed in float64 in micro-batch order, then over the DP ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algos.metrics import Metrics, Reduction


def reduce_over_micro_batches(
    metrics: list[Metrics], tokens: list[int], global_tokens: float, group, device: torch.device
) -> dict[str, float]:
    """This rank's per-micro-batch `metrics` (with `tokens`, each micro-batch's valid response
    tokens) -> the mini-batch's values over all ranks of the DP `group`, the same on each of them.
    `global_tokens`: the mini-batch's valid response tokens over all DP ranks."""
    names = list(metrics[0])
    reductions = [metrics[0].reduction(name) for name in names]
    sums = torch.zeros(len(names), dtype=torch.float64)
    extremes = torch.full((len(names),), float("-inf"), dtype=torch.float64)  # the min as the max of -value
    for micro, micro_tokens in zip(metrics, tokens):
        for i, (name, reduction) in enumerate(zip(names, reductions)):
            value = float(micro[name])
            if reduction is Reduction.MAX:
                extremes[i] = max(extremes[i], value)
            elif reduction is Reduction.MIN:
                extremes[i] = max(extremes[i], -value)
            elif reduction is Reduction.CONSTANT:
                sums[i] = value
            elif reduction is Reduction.SUM:
                sums[i] += value
            else:  # TOKEN_MEAN
                sums[i] += value * micro_tokens
    sums, extremes = sums.to(device), extremes.to(device)
    dist.all_reduce(sums, group=group)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    result = {}
    for i, (name, reduction) in enumerate(zip(names, reductions)):
        if reduction is Reduction.MAX:
            result[name] = float(extremes[i])
        elif reduction is Reduction.MIN:
            result[name] = -float(extremes[i])
        elif reduction is Reduction.CONSTANT:
            result[name] = float(sums[i]) / dist.get_world_size(group)
        elif reduction is Reduction.SUM:
            result[name] = float(sums[i])
        else:  # TOKEN_MEAN
            result[name] = float(sums[i]) / max(global_tokens, 1.0)
    return result


def broadcast_from_last_stage(metrics: dict) -> dict:
    """The last pipeline stage's `metrics` on every stage of this rank's pipeline."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics]
    dist.broadcast_object_list(
        box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]
