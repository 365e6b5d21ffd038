"""Batch scoring never stops on a bad sample; scores land on the last response token."""
import logging
import threading
import time

import pytest
import torch

from megarl.rewards.batch import RewardFunctionError, score_batch, token_level_scores
from megarl.rewards.code_reward import compute_code_score
from megarl.rewards.dispatch import UnknownDataSourceError, default_compute_score


def flaky(data_source, solution_str, ground_truth, extra_info):
    behaviour = {
        "raise": lambda: 1 / 0,
        "nan": lambda: float("nan"),
        "no score": lambda: {"acc": 1.0},
        "text": lambda: "1.0",
        "dict": lambda: {"score": 0.25, "acc": True, "pred": "x"},
    }
    return behaviour.get(solution_str, lambda: 1.0)()


def test_bad_samples_are_logged_scored_zero_and_counted(caplog):
    solutions = ["fine", "raise", "nan", "no score", "text", "dict"]
    with caplog.at_level(logging.WARNING, logger="megarl.rewards"):
        result = score_batch(flaky, ["d"] * 6, solutions, ["gt"] * 6)
    assert result.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.25]
    assert result.metrics["reward/num_errors"] == 4.0
    assert result.extra == {"acc": [None] * 5 + [True], "pred": [None] * 5 + ["x"]}
    assert result.metrics["reward/acc/mean"] == 1.0 and "reward/pred/mean" not in result.metrics
    messages = [r.getMessage() for r in caplog.records]
    assert any("sample 1 (data_source='d') failed, scored 0: ZeroDivisionError" in m for m in messages)
    assert any("sample 2" in m and "non-finite" in m for m in messages)


def test_threads_keep_order_and_unknown_sources_raise():
    solutions = [r"\boxed{%d}" % i for i in range(20)]
    truths = [str(i if i % 3 else -1) for i in range(20)]
    serial = score_batch(default_compute_score, ["lighteval/MATH"] * 20, solutions, truths)
    threaded = score_batch(default_compute_score, ["lighteval/MATH"] * 20, solutions, truths, max_workers=4)
    assert torch.equal(serial.scores, threaded.scores) and serial.extra == threaded.extra
    assert serial.scores.tolist() == [float(i % 3 != 0) for i in range(20)]
    with pytest.raises(UnknownDataSourceError, match="data_source='mystery'"):
        score_batch(default_compute_score, ["lighteval/MATH", "mystery"], ["a", "b"], ["1", "2"], max_workers=2)
    with pytest.raises(ValueError, match="one entry per sample"):
        score_batch(default_compute_score, ["a"], ["x", "y"], ["1", "2"])


def test_a_looping_program_does_not_block_the_batch():
    tests = {"inputs": ["2\n"], "outputs": ["4"]}
    programs = ["print(int(input()) * 2)", "while True:\n    pass", "print(int(input()) ** 2)", "raise SystemExit(3)"]

    def code_reward(data_source, solution_str, ground_truth, extra_info):
        return compute_code_score(solution_str, ground_truth, timeout_s=1)

    result = score_batch(code_reward, ["apps"] * 4, programs, [tests] * 4, max_workers=2)
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert result.metrics["reward/timed_out/sum"] == 1.0 and result.metrics["reward/crashed/sum"] == 1.0
    assert result.metrics["reward/num_errors"] == 0.0


def test_a_hanging_reward_scores_zero_is_counted_and_does_not_hold_the_batch():
    release = threading.Event()

    def hangs_on_b(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "b":
            release.wait(60)  # a stuck call (network, lock, ...)
        return 1.0

    start = time.monotonic()
    result = score_batch(hangs_on_b, ["d"] * 4, ["a", "b", "c", "b"], ["gt"] * 4, max_workers=2, timeout_s=0.5)
    elapsed = time.monotonic() - start
    release.set()
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert result.metrics["reward/num_timeouts"] == 2.0 and result.metrics["reward/num_errors"] == 2.0
    assert elapsed < 5, f"two windows of 0.5 s took {elapsed:.1f} s"


@pytest.mark.timeout(30)
def test_with_one_worker_a_hanging_sample_is_abandoned_and_the_rest_still_scored():
    """One worker thread per batch: when its sample runs past the deadline a new worker takes the
    rest of the batch (without it, samples after the hang would never be scored)."""
    release = threading.Event()
    scored_by = {}  # sample -> the Thread object that scored it (kept: no reuse of identities)

    def hangs_on_first(data_source, solution_str, ground_truth, extra_info):
        scored_by[solution_str] = threading.current_thread()
        if solution_str == "hang":
            release.wait(60)
        return 1.0

    start = time.monotonic()
    result = score_batch(hangs_on_first, ["d"] * 4, ["hang", "a", "b", "c"], ["gt"] * 4, timeout_s=0.3)
    elapsed = time.monotonic() - start
    release.set()
    assert result.scores.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert result.metrics["reward/num_timeouts"] == 1.0
    assert elapsed < 3, f"one deadline of 0.3 s took {elapsed:.1f} s"
    assert scored_by["a"] is scored_by["b"] is scored_by["c"] is not scored_by["hang"], \
        "one thread per batch, and one more per timeout: not one per sample"


def test_a_reward_that_fails_on_every_sample_stops_with_the_first_error():
    def broken(data_source, solution_str, ground_truth, extra_info):
        raise KeyError("ground_truth has no 'answer'")

    with pytest.raises(RewardFunctionError, match=r"failed on all 3 samples.*KeyError.*no 'answer'"):
        score_batch(broken, ["d"] * 3, ["a", "b", "c"], ["gt"] * 3)


def test_token_level_scores():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]])  # row 2 has a hole
    out = token_level_scores(torch.tensor([0.5, -1.0, 2.0]), mask)
    assert out.tolist() == [[0.0, 0.5, 0.0, 0.0], [0.0, 0.0, -1.0, 0.0], [0.0, 0.0, 0.0, 2.0]]
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"responses \[1\] have no valid token"):
        token_level_scores(torch.tensor([1.0, 1.0]), torch.tensor([[1, 0], [0, 0]]))
