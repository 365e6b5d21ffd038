"""Rewards: verifiable scorers (math, GSM8K, sandboxed code, reasoning-gym's own), dispatch by data_source, a user's
reward function from a file, and batch scoring that never stops on one bad sample.

    score_fn = select_score_fn(cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                               cfg.custom_reward_function.reward_kwargs)
    rewards = score_batch(score_fn, data_sources, responses, ground_truths, extra_infos)
    token_scores = token_level_scores(rewards.scores, response_mask)   # [batch, response_len]
"""
from megarl.rewards.batch import RewardBatch, score_batch, token_level_scores
from megarl.rewards.code_reward import compute_code_score
from megarl.rewards.custom import load_custom_reward_fn, select_score_fn
from megarl.rewards.dispatch import UnknownDataSourceError, default_compute_score, scorer_for
from megarl.rewards.math_reward import answers_match, compute_gsm8k_score, compute_math_score

__all__ = [
    "RewardBatch",
    "UnknownDataSourceError",
    "answers_match",
    "compute_code_score",
    "compute_gsm8k_score",
    "compute_math_score",
    "default_compute_score",
    "load_custom_reward_fn",
    "score_batch",
    "scorer_for",
    "select_score_fn",
    "token_level_scores",
]
