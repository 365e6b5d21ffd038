"""Per-rollout figures: volume, throughput, latency percentiles and the long tail.

The longest sample bounds a synchronous RL step, so it is reported on its own: its length and the
wall time of the request that produced it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RequestRecord:
    """What one prompt's `/generate` request cost: tokens per sample, wall time, attempts."""

    prompt_tokens: int  # tokens of the prompt (each of its samples reads them)
    response_tokens: tuple[int, ...]  # generated tokens of each returned sample
    latency_s: float  # wall time of the attempt that succeeded (0 when none did: aborted before)
    attempts: int  # HTTP attempts made (1 = no retry; 0 = never sent, aborted before)
    aborted_samples: int  # samples that finished with reason "abort"


@dataclass(frozen=True)
class RolloutMetrics:
    requests: int
    samples: int
    prompt_tokens: int  # summed over samples
    response_tokens: int
    wall_s: float
    tokens_per_s: float  # response tokens per wall second
    latency_p50_s: float
    latency_p90_s: float
    latency_p99_s: float
    latency_max_s: float
    longest_sample_tokens: int
    longest_sample_s: float  # wall time of the request holding the longest sample
    aborted_samples: int
    retried_requests: int  # requests that needed more than one attempt
    retries: int  # extra attempts, summed

    def as_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in asdict(self).items()}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 1]); 0.0 for an empty list."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(records: list[RequestRecord], wall_s: float) -> RolloutMetrics:
    latencies = sorted(r.latency_s for r in records if r.latency_s > 0)
    response_tokens = sum(sum(r.response_tokens) for r in records)
    longest = max(records, key=lambda r: max(r.response_tokens, default=0), default=None)
    return RolloutMetrics(
        requests=len(records),
        samples=sum(len(r.response_tokens) for r in records),
        prompt_tokens=sum(r.prompt_tokens * len(r.response_tokens) for r in records),
        response_tokens=response_tokens,
        wall_s=wall_s,
        tokens_per_s=response_tokens / wall_s if wall_s > 0 else 0.0,
        latency_p50_s=percentile(latencies, 0.50),
        latency_p90_s=percentile(latencies, 0.90),
        latency_p99_s=percentile(latencies, 0.99),
        latency_max_s=latencies[-1] if latencies else 0.0,
        longest_sample_tokens=max(longest.response_tokens, default=0) if longest else 0,
        longest_sample_s=longest.latency_s if longest else 0.0,
        aborted_samples=sum(r.aborted_samples for r in records),
        retried_requests=sum(1 for r in records if r.attempts > 1),
        retries=sum(max(r.attempts - 1, 0) for r in records),
    )
