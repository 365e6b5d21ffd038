"""The batch container: shapes checked, split/concat/select/repeat, padding on concat."""
import pytest
import torch

from megarl.data.batch import Batch


def sample_batch():
    batch = Batch.from_token_lists([[5, 6, 7], [8]], [[9], [10, 11, 12]], uid=["a", "b"])
    batch["old_log_probs"] = torch.tensor([[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]])
    batch["rewards"] = torch.tensor([1.0, 0.0])
    return batch


def test_from_token_lists_pads_prompts_left_and_responses_right():
    b = sample_batch()
    assert b["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert b["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b["response_ids"].tolist() == [[9, 0, 0], [10, 11, 12]]
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert len(b) == 2 and b.response_length == 3 and b["uid"] == ["a", "b"]
    assert b.token_lengths().tolist() == [4, 4]


def test_select_reorders_tensors_and_meta_together():
    b = sample_batch().select([1, 0, 1])
    assert b["uid"] == ["b", "a", "b"]
    assert b["response_ids"][:, 0].tolist() == [10, 9, 10]
    assert b["rewards"].tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(IndexError, match=r"indices must lie in \[0, 2\)"):
        sample_batch().select([2])


def test_split_chunk_concat_round_trip():
    b = Batch.concat([sample_batch(), sample_batch().select([1, 0])])
    assert len(b) == 4 and b["uid"] == ["a", "b", "b", "a"]
    pieces = b.split(3)
    assert [len(p) for p in pieces] == [3, 1]
    again = Batch.concat(pieces)
    for key in b.tensors:
        assert torch.equal(again[key], b[key])
    assert [len(c) for c in b.chunk(2)] == [2, 2]
    with pytest.raises(ValueError, match="not divisible into 3 equal parts"):
        b.chunk(3)


def test_concat_pads_to_the_widest_batch():
    narrow = Batch.from_token_lists([[1]], [[2]], uid=["n"])
    narrow["advantages"] = torch.tensor([[0.5]])
    wide = Batch.from_token_lists([[3, 4]], [[5, 6]], uid=["w"])
    wide["advantages"] = torch.tensor([[1.0, 2.0]])
    b = Batch.concat([narrow, wide])
    assert b["prompt_ids"].tolist() == [[0, 1], [3, 4]]  # left-padded
    assert b["prompt_mask"].tolist() == [[0, 1], [1, 1]]
    assert b["response_ids"].tolist() == [[2, 0], [5, 6]]  # right-padded
    assert b["advantages"].tolist() == [[0.5, 0.0], [1.0, 2.0]]


def test_repeat_interleave_makes_groups():
    b = sample_batch().repeat_interleave(3)
    assert b["uid"] == ["a"] * 3 + ["b"] * 3
    assert b["prompt_ids"][:, -1].tolist() == [7, 7, 7, 8, 8, 8]


def test_to_moves_every_tensor():
    b = sample_batch().to("meta")
    assert all(t.device.type == "meta" for t in b.tensors.values())
    assert b["uid"] == ["a", "b"]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("advantages", torch.zeros(2, 4), r"share one response length .*'response_ids' 3.*'advantages' 4"),
        ("rewards", torch.zeros(3), r"batch size; got .*tensor 'rewards': 3"),
        ("uid", ["only-one"], r"meta 'uid': 1"),
        ("prompt_ids", torch.zeros(2, 3, 1), r"'prompt_ids' must be \[batch, prompt_len\]"),
    ],
)
def test_bad_shapes_are_refused_and_leave_the_batch_unchanged(key, value, message):
    b = sample_batch()
    before = {k: v.clone() if isinstance(v, torch.Tensor) else list(v) for k, v in ((k, b[k]) for k in b.keys())}
    with pytest.raises(ValueError, match=message):
        b[key] = value
    assert b.keys() == list(before)
    assert all(torch.equal(b[k], v) if isinstance(v, torch.Tensor) else b[k] == v for k, v in before.items())


def test_concat_needs_the_same_keys():
    other = sample_batch()
    other["values"] = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="batch 1 has keys"):
        Batch.concat([sample_batch(), other])


def test_pickling_keeps_every_tensor_exactly_also_from_read_only_buffers():
    """Ray pickles a batch (protocol 5, its buffers out of band and handed back read-only): every
    tensor comes back equal with its dtype, shape and strides, writable, not sharing the buffers."""
    import pickle

    b = sample_batch()
    b["bf16"] = torch.randn(2, 3).to(torch.bfloat16)
    b["flags"] = torch.tensor([[True, False, True], [False, False, True]])
    b["per_expert"] = torch.randn(2, 4, 3).transpose(1, 2)  # not contiguous: torch pickles it itself
    b["empty"] = torch.zeros(2, 3, 0, dtype=torch.float64)
    b["small"] = torch.tensor([1, 60000], dtype=torch.int32).to(torch.uint16)
    buffers = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    copies = [pickle.loads(pickle.dumps(b, protocol=4)),
              pickle.loads(data, buffers=[memoryview(x.raw().tobytes()).toreadonly() for x in buffers])]
    for copy in copies:
        assert copy.meta == b.meta and list(copy.tensors) == list(b.tensors)
        for key, t in b.tensors.items():
            got = copy[key]
            assert (got.dtype, got.shape, got.stride()) == (t.dtype, t.shape, t.stride()), key
            assert torch.equal(got.view(torch.int16), t.view(torch.int16)) if t.dtype == torch.uint16 else \
                torch.equal(got, t), key
        copy["bf16"].add_(1)  # writable, and its own memory
    assert not torch.equal(copies[1]["bf16"], b["bf16"])
