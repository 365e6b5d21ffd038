"""A mini-batch's training metrics from its micro-batches on every data-parallel rank.

Each micro-batch's loss head reports `megarl.algos.metrics.Metrics`, every value declared with its
`Reduction`; `reduce_over_micro_batches` combines them by that declaration. The values are
summed in float64 in micro-batch order, then over the DP ranks in rank order, for all the
mini-batches of an update in one collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megarl.algos.metrics import Metrics, Reduction


def reduce_over_micro_batches(
    mini_batches: list[tuple[list[Metrics], list[int]]], global_tokens: list[float], group, device: torch.device
) -> list[dict[str, float]]:
    """Each mini-batch's metrics over all ranks of the DP `group`, the same on each of them, from
    one all-gather for all the mini-batches of an update. `mini_batches`: per mini-batch, this
    rank's per-micro-batch `Metrics` and each micro-batch's valid response tokens;
    `global_tokens`: per mini-batch, its valid response tokens over all DP ranks."""
    layouts, parts = [], []
    for metrics, tokens in mini_batches:
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
        layouts.append((names, reductions))
        parts += [sums, extremes]
    mine = torch.cat(parts).to(device)
    ranks = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(ranks, mine, group=group)  # one collective for the sums and the extremes (SUM and MAX)
    summed, peak = ranks[0].clone(), ranks[0].clone()
    for other in ranks[1:]:  # in rank order: the same result on every rank
        summed += other
        peak = torch.maximum(peak, other)
    results, offset = [], 0
    for (names, reductions), mini_tokens in zip(layouts, global_tokens):
        sums, extremes = summed[offset : offset + len(names)], peak[offset + len(names) : offset + 2 * len(names)]
        offset += 2 * len(names)
        result = {}
        for i, (name, reduction) in enumerate(zip(names, reductions)):
            if reduction is Reduction.MAX:
                result[name] = float(extremes[i])
            elif reduction is Reduction.MIN:
                result[name] = -float(extremes[i])
            elif reduction is Reduction.CONSTANT:
                result[name] = float(sums[i]) / len(ranks)
            elif reduction is Reduction.SUM:
                result[name] = float(sums[i])
            else:  # TOKEN_MEAN
                result[name] = float(sums[i]) / max(mini_tokens, 1.0)
        results.append(result)
    return results


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
