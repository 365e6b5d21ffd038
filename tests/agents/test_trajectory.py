import pytest

from megarl.agents.records import CallRecord, EpisodeLimitError, TrajectoryRecorder, UnknownTrajectoryError
from megarl.agents.trajectory import PrefixMismatchError, assemble_trajectory


def call(prompt, out, lps=None, finish="stop"):
    return CallRecord(prompt, out, lps if lps is not None else [-0.1 * (i + 1) for i in range(len(out))], finish)


def test_three_turns_interleave_generated_and_added_tokens():
    c0 = call([1, 5, 6], [7, 8, 2], [-0.5, -0.6, -0.7])
    c1 = call([1, 5, 6, 7, 8, 2, 30, 31], [9, 2], [-1.0, -1.1])          # tool output 30 31
    c2 = call([1, 5, 6, 7, 8, 2, 30, 31, 9, 2, 40], [10], [-2.0], "length")  # user turn 40
    t = assemble_trajectory([c0, c1, c2])
    assert t.prompt_ids == [1, 5, 6]
    assert t.response_ids == [7, 8, 2, 30, 31, 9, 2, 40, 10]
    assert t.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 1]
    assert t.rollout_log_probs == [-0.5, -0.6, -0.7, 0.0, 0.0, -1.0, -1.1, 0.0, -2.0]
    assert (t.num_calls, t.finish_reason, t.generated_tokens) == (3, "length", 6)


def test_single_call_is_a_plain_row():
    t = assemble_trajectory([call([1, 2], [3, 4])])
    assert (t.prompt_ids, t.response_ids, t.loss_mask) == ([1, 2], [3, 4], [1, 1])


def test_a_prompt_that_does_not_extend_the_history_is_refused():
    c0 = call([1, 5], [7, 8])
    with pytest.raises(PrefixMismatchError, match="first difference at token 3"):
        assemble_trajectory([c0, call([1, 5, 7, 9, 30], [3])])  # the sampled 8 was re-tokenised as 9
    with pytest.raises(PrefixMismatchError):
        assemble_trajectory([c0, call([1, 5, 7], [3])])  # history cut short


def test_bad_records_are_errors():
    with pytest.raises(ValueError, match="without model calls"):
        assemble_trajectory([])
    with pytest.raises(ValueError, match="2 sampled ids but 1 log-probs"):
        assemble_trajectory([call([1], [2, 3], [-1.0])])


def test_recorder_limits_turns_and_tokens():
    rec = TrajectoryRecorder(max_turns=2, max_tokens_per_episode=10)
    rec.open("a")
    assert rec.begin_call("a", prompt_tokens=4, max_new_tokens=8) == 6  # cut to the 10-token budget
    assert rec.begin_call("a", prompt_tokens=2, max_new_tokens=3) == 3
    with pytest.raises(EpisodeLimitError) as e:
        rec.begin_call("a", prompt_tokens=2, max_new_tokens=3)
    assert e.value.limit == "max_turns"
    rec.open("b")
    with pytest.raises(EpisodeLimitError, match="leaving none"):
        rec.begin_call("b", prompt_tokens=10, max_new_tokens=3)
    assert rec.close("a").limit_hit == "max_turns" and rec.close("b").limit_hit == "max_tokens_per_episode"
    with pytest.raises(UnknownTrajectoryError):
        rec.begin_call("a", 1, 1)
    rec.add("a", call([1], [2]))  # a late answer for a closed trajectory is dropped
    with pytest.raises(ValueError, match="already open"):
        rec.open("c") or rec.open("c")
