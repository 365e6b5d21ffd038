"""Deterministic, resumable sampling."""
import pytest

from megarl.config.schema import DataConfig
from megarl.data.errors import DataError
from megarl.data.sampler import EpochSampler


def draw(sampler, steps):
    return [sampler.next_batch() for _ in range(steps)]


def test_each_epoch_is_a_permutation_with_the_remainder_dropped():
    sampler = EpochSampler(10, 3, seed=7)
    assert sampler.batches_per_epoch == 3
    epochs = [draw(sampler, 3) for _ in range(3)]
    for batches in epochs:
        seen = [i for b in batches for i in b]
        assert all(len(b) == 3 for b in batches)
        assert len(set(seen)) == 9 and set(seen) <= set(range(10))
    assert epochs[0] != epochs[1] != epochs[2]  # a new order every epoch
    assert sampler.epoch == 2


def test_same_seed_same_batches_other_seed_other_batches():
    assert draw(EpochSampler(100, 8, seed=1), 20) == draw(EpochSampler(100, 8, seed=1), 20)
    assert draw(EpochSampler(100, 8, seed=1), 20) != draw(EpochSampler(100, 8, seed=2), 20)


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 5, 11])
def test_resumed_sampler_sees_exactly_the_uninterrupted_batches(stop_after):
    uninterrupted = draw(EpochSampler(13, 4, seed=3), 16)  # 3 batches per epoch: crosses 5 epoch boundaries
    first = EpochSampler(13, 4, seed=3)
    before = draw(first, stop_after)
    state = dict(first.state_dict())
    resumed = EpochSampler(13, 4, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert before + draw(resumed, 16 - stop_after) == uninterrupted


def test_without_shuffle_and_drop_last_the_last_batch_is_short():
    sampler = EpochSampler(5, 2, shuffle=False, drop_last=False)
    assert sampler.batches_per_epoch == 3
    assert draw(sampler, 4) == [[0, 1], [2, 3], [4], [0, 1]]


def test_resume_with_a_different_dataset_is_refused():
    state = EpochSampler(100, 10).state_dict()
    with pytest.raises(DataError, match="saved num_samples=100, this run has 90"):
        EpochSampler(90, 10).load_state_dict(state)


def test_fewer_prompts_than_one_batch():
    with pytest.raises(DataError, match="the dataset has 5 prompts, fewer than one batch of 8"):
        EpochSampler(5, 8)


def test_from_config():
    config = DataConfig(train_batch_size=4, shuffle=False, val_batch_size=None)
    train = EpochSampler.from_config(config, 10)
    assert draw(train, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]
    val = EpochSampler.from_config(config, 10, "val")
    assert draw(val, 1) == [list(range(10))]
    config.shuffle, config.seed = True, 5
    assert draw(EpochSampler.from_config(config, 10), 2) == draw(EpochSampler(10, 4, seed=5), 2)


def test_from_config_draws_gen_batch_size_prompts_per_round():
    config = DataConfig(train_batch_size=4, gen_batch_size=6, shuffle=False)
    assert draw(EpochSampler.from_config(config, 13), 3) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5]]
    with pytest.raises(DataError, match=r"5 usable prompts, fewer than one batch \(data.gen_batch_size=6\)"):
        EpochSampler.from_config(config, 5)
    with pytest.raises(DataError, match=r"fewer than one batch \(data.train_batch_size=4\)"):
        EpochSampler.from_config(DataConfig(train_batch_size=4), 3)
