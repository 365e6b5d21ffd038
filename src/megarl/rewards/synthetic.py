"""Scorers of megarl's synthetic tasks (tools/make_dataset.py, megarl.data.synthetic).

Each is a pure function fn(solution_str, ground_truth) -> 1.0 or 0.0: exact match of the
response, cut at its first end-of-sequence marker and stripped of whitespace, with the answer.
"""
from __future__ import annotations

from typing import Callable

# End-of-sequence and padding texts a decoded response may still carry (decoded without
# skip_special_tokens): the tiny models' own, and those of common chat models.
END_MARKERS = ("<eos>", "<pad>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>")


def strip_response(solution_str: str) -> str:
    """The response up to its first end marker, without surrounding whitespace."""
    end = min((i for i in (solution_str.find(m) for m in END_MARKERS) if i >= 0), default=len(solution_str))
    return solution_str[:end].strip()


def exact_match(solution_str: str, ground_truth: str) -> float:
    """1.0 if the stripped response equals the stripped ground truth, else 0.0."""
    return float(strip_response(solution_str) == str(ground_truth).strip())


SYNTHETIC_SCORERS: dict[str, Callable[[str, str], float]] = {
    "megarl/add": exact_match,  # "23+45=" -> "68"
    "megarl/rev": exact_match,  # "kqbd>" -> "dbqk"
    "megarl/sort": exact_match,  # "31415:" -> "11345"
}
