"""DAPO: group filtering, dynamic sampling over rounds, overlong penalty."""
import pytest
import torch

from megarl.algos.dapo import DynamicSampler, DynamicSamplingExhausted, filter_informative_groups, overlong_penalty


def test_filter_keeps_only_groups_with_different_rewards():
    uids = ["a", "b", "a", "c", "b", "d", "d"]
    acc = [1, 0, 0, 1, 0, 1, 0]
    result = filter_informative_groups(uids, acc)
    assert result.keep_indices == [0, 2, 5, 6]  # b is all 0, c a single response
    assert result.kept_groups == ["a", "d"] and result.num_groups == 4


def test_sampler_fills_the_batch_over_rounds_with_whole_groups():
    sampler = DynamicSampler(target_groups=3, max_rounds=0)
    keep = sampler.add(["p", "p", "q", "q"], [1, 1, 0, 1])  # only q
    assert keep == [2, 3] and not sampler.is_full
    keep = sampler.add(["r", "s", "r", "s", "t", "t"], [0, 1, 1, 0, 0, 1])  # r, s, t informative; 2 needed
    assert keep == [0, 1, 2, 3] and sampler.is_full
    assert sampler.metrics() == pytest.approx({"kept_ratio": 3 / 5, "num_gen_rounds": 2.0, "kept_groups": 3.0})
    with pytest.raises(RuntimeError, match="full batch"):
        sampler.add(["x"], [0])


def test_sampler_cap_raises_with_the_numbers():
    sampler = DynamicSampler(target_groups=2, max_rounds=2)
    sampler.add(["a", "a"], [1, 0])
    with pytest.raises(DynamicSamplingExhausted, match="kept 1 of the 2 groups needed after 2 generation rounds"):
        sampler.add(["b", "b"], [1, 1])


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([3, 6, 7, 8, 10])
    got = overlong_penalty(lengths, max_response_length=10, buffer_len=4, penalty_factor=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert overlong_penalty(lengths, 10, 4, penalty_factor=0.5).tolist() == pytest.approx([0, 0, -0.125, -0.25, -0.5])
    assert overlong_penalty(lengths, 10, 0).eq(0).all()
    with pytest.raises(ValueError, match="buffer_len=11"):
        overlong_penalty(lengths, 10, 11)
