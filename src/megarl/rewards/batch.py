"""Score a batch of responses, never stopping on one bad sample, and place scores on tokens.

`score_batch` calls a score function (`custom.select_score_fn`) on every sample, optionally in
threads (useful for code rewards, which wait on subprocesses). A sample whose scoring raises, or
returns something other than a finite float or a dict with a finite "score", is logged with
its index, scored 0 and counted. An unknown data_source is not a sample's fault: it raises.
"""
from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable, Optional, Sequence

import torch

from megarl.rewards.dispatch import UnknownDataSourceError

log = logging.getLogger("megarl.rewards")


@dataclass
class RewardBatch:
    scores: torch.Tensor  # [batch] float32
    extra: dict[str, list]  # key -> per-sample values from dict results (None where a sample has none)
    metrics: dict[str, float]  # reward/score_mean, reward/num_errors, reward/<key>/mean and /sum


def _as_score(value: Any) -> tuple[float, dict[str, Any]]:
    """(score, extra) from a scorer's result; ValueError if it is not a finite score."""
    extra: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"returned a dict without 'score' (keys {sorted(value)})")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if not isinstance(value, Real):
        raise ValueError(f"returned {type(value).__name__}, expected a float or a dict with 'score'")
    if not math.isfinite(value):
        raise ValueError(f"returned the non-finite score {value}")
    return float(value), extra


def score_batch(
    score_fn: Callable[..., Any],
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Optional[Sequence[Optional[dict]]] = None,
    *,
    max_workers: int = 1,
) -> RewardBatch:
    """Per-sample scores `[batch]` with per-sample extras and batch metrics."""
    n = len(solution_strs)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    lengths = {"data_sources": len(data_sources), "solution_strs": n, "ground_truths": len(ground_truths),
               "extra_infos": len(extra_infos)}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"score_batch needs one entry per sample in each list, got lengths {lengths}")
    failures: list[int] = []

    def score_one(i: int) -> tuple[float, dict[str, Any]]:
        try:
            return _as_score(score_fn(data_source=data_sources[i], solution_str=solution_strs[i],
                                      ground_truth=ground_truths[i], extra_info=extra_infos[i]))
        except UnknownDataSourceError:
            raise
        except Exception as error:
            failures.append(i)
            log.warning("reward for sample %d (data_source=%r) failed, scored 0: %s: %s", i, data_sources[i],
                        type(error).__name__, error, exc_info=len(failures) == 1)
            return 0.0, {}

    if max_workers <= 1:
        results = [score_one(i) for i in range(n)]
    else:
        with ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward") as pool:
            futures = [pool.submit(score_one, i) for i in range(n)]
            try:
                results = [future.result() for future in futures]
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise

    scores = [score for score, _ in results]
    keys = sorted({key for _, extra in results for key in extra})
    extra = {key: [e.get(key) for _, e in results] for key in keys}
    metrics = {"reward/score_mean": sum(scores) / n if n else 0.0, "reward/num_errors": float(len(failures))}
    for key, values in extra.items():
        numbers = [float(v) for v in values if isinstance(v, Real)]
        if numbers:
            metrics[f"reward/{key}/mean"] = sum(numbers) / len(numbers)
            metrics[f"reward/{key}/sum"] = sum(numbers)
    return RewardBatch(torch.tensor(scores, dtype=torch.float32), extra, metrics)


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """`[batch]` scores -> `[batch, response_len]` float32, each score on its response's last valid
    token and 0 elsewhere. A response without a valid token is an error (its score has no place)."""
    valid = response_mask.bool()
    empty = (~valid.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"responses {empty} have no valid token in response_mask to carry their score")
    length = valid.shape[-1]
    last = length - 1 - valid.flip(-1).to(torch.uint8).argmax(dim=-1)
    out = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    out[torch.arange(valid.shape[0], device=valid.device), last] = scores.to(valid.device, torch.float32)
    return out
