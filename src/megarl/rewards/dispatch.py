"""The default reward: pick a scorer by the sample's `data_source`, as verl's default_compute_score.

    openai/gsm8k                                      GSM8K scorer ("####" answers)
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, math_dapo,
    numina_*, and any source starting with "aime"     math scorer (\\boxed{} answers)
    codecontests, apps, codeforces, taco              code scorer (sandboxed tests)
    megarl/* synthetic tasks                          `megarl.rewards.synthetic.SYNTHETIC_SCORERS`
    reasoning_gym/<task>                              the task's own score_answer (megarl.rewards.reasoning_gym;
                                                      reads extra_info)

An unknown data_source raises UnknownDataSourceError naming it and the known ones.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from megarl.rewards.code_reward import compute_code_score
from megarl.rewards.math_reward import compute_gsm8k_score, compute_math_score
from megarl.rewards.reasoning_gym import SOURCE_PREFIX as REASONING_GYM_PREFIX
from megarl.rewards.reasoning_gym import score_reasoning_gym

from megarl.rewards.synthetic import SYNTHETIC_SCORERS

Score = Union[float, dict[str, Any]]
Scorer = Callable[[str, Any], Score]  # (solution_str, ground_truth) -> score

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = (
    "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo",
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads",
)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
MATH_PREFIXES = ("aime",)

SCORERS: dict[str, Scorer] = {
    **{source: compute_gsm8k_score for source in GSM8K_SOURCES},
    **{source: compute_math_score for source in MATH_SOURCES},
    **{source: compute_code_score for source in CODE_SOURCES},
    **SYNTHETIC_SCORERS,
}


class UnknownDataSourceError(ValueError):
    """No default scorer for a data_source: a data or config problem, not one bad sample."""


def scorer_for(data_source: str) -> Scorer:
    """The default scorer of `data_source`."""
    if data_source in SCORERS:
        return SCORERS[data_source]
    if isinstance(data_source, str) and data_source.startswith(MATH_PREFIXES):
        return compute_math_score
    raise UnknownDataSourceError(
        f"no default reward for data_source={data_source!r}; known: {sorted(SCORERS)} and names starting "
        f"with {list(MATH_PREFIXES)} or {REASONING_GYM_PREFIX!r}; set custom_reward_function.path to score it "
        "with your own function"
    )


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: Optional[dict] = None) -> Score:
    """Score one response with the default scorer of its data_source (extra_info is read by
    reasoning-gym's rows only)."""
    if isinstance(data_source, str) and data_source.startswith(REASONING_GYM_PREFIX):
        return score_reasoning_gym(data_source, solution_str, extra_info)
    return scorer_for(data_source)(solution_str, ground_truth)
