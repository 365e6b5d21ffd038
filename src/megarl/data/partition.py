"""Splitting samples by token count: balanced across data-parallel ranks, and into micro-batches
under a token budget (`*_max_token_len_per_gpu`). Pure functions of a list of lengths; no torch.

Every function returns lists of sample indices that together hold each index exactly once,
each list in ascending order, and gives the same answer for the same input.

    per_rank = balance_across_ranks(batch.token_lengths().tolist(), dp_size)      # rank r: batch.select(per_rank[r])
    mine = batch.select(per_rank[dp_rank])
    for indices in token_budget_micro_batches(mine.token_lengths().tolist(), max_token_len_per_gpu):
        packed = pack(mine.select(indices))                                        # megarl.data.packing
"""
from __future__ import annotations

import heapq
import math
from typing import Callable, Sequence


def karmarkar_karp(weights: Sequence[int], parts: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices into `parts` sets of near-equal weight sum (largest differencing method).

    equal_size: every set gets len(weights) / parts indices (must divide evenly).
    """
    order = _check(weights, parts, equal_size)
    # A state is `parts` subsets [(sum, indices)], heaviest first; merging two states pairs the
    # heaviest subsets of one with the lightest of the other, which shrinks the spread.
    if equal_size:
        seeds = [order[i : i + parts] for i in range(0, len(order), parts)]
        states = [[(weights[i], [i]) for i in group] for group in seeds]
    else:
        states = [[(weights[i], [i])] + [(0, [])] * (parts - 1) for i in order]
    heap = [(-(s[0][0] - s[-1][0]), n, s) for n, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [sorted(indices) for _, indices in heap[0][2]]


def sorted_greedy(weights: Sequence[int], parts: int, equal_size: bool = False) -> list[list[int]]:
    """Split indices into `parts` sets: heaviest first, each to the currently lightest set
    (among those not yet full when equal_size)."""
    order = _check(weights, parts, equal_size)
    capacity = len(weights) // parts if equal_size else len(weights)
    sets: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, p) for p in range(parts)]
    for i in order:
        total, p = heapq.heappop(heap)
        sets[p].append(i)
        if len(sets[p]) < capacity:
            heapq.heappush(heap, (total + weights[i], p))
    return [sorted(s) for s in sets]


BALANCERS: dict[str, Callable[[Sequence[int], int, bool], list[list[int]]]] = {
    "karmarkar_karp": karmarkar_karp,
    "sorted_greedy": sorted_greedy,
}


def _check(weights: Sequence[int], parts: int, equal_size: bool) -> list[int]:
    """Indices heaviest first (ties: lower index first), after checking the arguments."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if equal_size and len(weights) % parts:
        raise ValueError(f"{len(weights)} samples cannot be split into {parts} equal parts")
    if any(w < 0 for w in weights):
        raise ValueError("weights must be non-negative")
    return sorted(range(len(weights)), key=lambda i: (-weights[i], i))


def balance_across_ranks(lengths: Sequence[int], world_size: int, method: str = "karmarkar_karp") -> list[list[int]]:
    """Per data-parallel rank, an equal number of sample indices with near-equal token totals."""
    return _balancer(method)(lengths, world_size, True)


def verl_workload(length: int) -> int:
    """verl's relative compute of one sequence of `length` tokens, which its batch balancing
    evens out (verl 0.9.1 utils/seqlen_balancing.py `calculate_workload`: 24576 L + L^2, a dense
    block's 12 h^2 L + 2 h L^2 over 2 h at h = 4096)."""
    return 24576 * length + length * length


def balance_batch_order(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """verl's `trainer.balance_batch` (0.9.1 trainer/ppo/ray_trainer.py `_balance_batch`): per
    data-parallel rank, an equal number of sample indices with near-equal `verl_workload` (largest
    differencing), each rank's indices ordered by workload with the lighter ones at both ends
    (sorted by (workload, index), then the even positions rising and the odd ones falling: verl's
    order against pipeline bubbles). Concatenated, rank r's samples are the r-th of `dp_size` equal
    consecutive pieces, as the trainer hands them out."""
    workloads = [verl_workload(n) for n in lengths]
    order = []
    for part in balance_across_ranks(workloads, dp_size):
        part = sorted(part, key=lambda i: (workloads[i], i))
        order.append(part[::2] + part[1::2][::-1])
    return order


def balance_metrics(lengths: Sequence[int], order: Sequence[Sequence[int]], prefix: str = "global_seqlen") -> dict:
    """verl's balance metrics (utils/seqlen_balancing.py `log_seqlen_unbalance`), tokens per rank:
    `min`/`max` of the equal consecutive pieces before balancing, `minmax_diff`, `balanced_min`/
    `balanced_max` after it (`order`, from `balance_batch_order`), `mean`."""
    piece = len(lengths) // len(order)
    before = [sum(lengths[start : start + piece]) for start in range(0, len(lengths), piece)]
    after = [sum(lengths[i] for i in part) for part in order]
    return {f"{prefix}/min": min(before), f"{prefix}/max": max(before), f"{prefix}/minmax_diff": max(before) - min(before),
            f"{prefix}/balanced_min": min(after), f"{prefix}/balanced_max": max(after),
            f"{prefix}/mean": sum(lengths) / len(order)}


def token_budget_micro_batches(
    lengths: Sequence[int], max_tokens: int, *, min_micro_batches: int = 1, method: str = "karmarkar_karp"
) -> list[list[int]]:
    """Fewest balanced micro-batches (at least `min_micro_batches`) each holding at most
    `max_tokens` tokens; ordered by their first index. Pass the largest count over data-parallel
    ranks as min_micro_batches to give every rank the same number of micro-batches."""
    balance = _balancer(method)
    if not lengths:
        raise ValueError("token_budget_micro_batches: no samples")
    if min(lengths) < 1:
        raise ValueError(f"sample {min(range(len(lengths)), key=lambda i: lengths[i])} has no tokens")
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] > max_tokens:
        raise ValueError(
            f"sample {longest} has {lengths[longest]} tokens, more than the micro-batch budget of {max_tokens} "
            "(raise *_max_token_len_per_gpu to at least max_prompt_length + max_response_length)"
        )
    if min_micro_batches > len(lengths):
        raise ValueError(f"cannot make {min_micro_batches} micro-batches out of {len(lengths)} samples")
    parts = max(min_micro_batches, math.ceil(sum(lengths) / max_tokens))
    while True:
        batches = balance(lengths, parts, False)
        if all(sum(lengths[i] for i in b) <= max_tokens for b in batches):
            return sorted(batches, key=lambda b: b[0])
        parts += 1


def _balancer(method: str):
    if method not in BALANCERS:
        raise ValueError(f"unknown balancing method {method!r}; choose from {', '.join(BALANCERS)}")
    return BALANCERS[method]
