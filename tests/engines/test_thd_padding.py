"""Packed (THD) micro-batches with context parallelism as transformer-engine reads them: its CP
attention takes each sequence's padded offsets (cu_seqlens_padded) only when it sees padding between
sequences, so a last sequence that ends in padding is followed by a filler sequence
(`sequences.thd_filler`). megarl's CPU reference attention reads the padded offsets either way, so
these tests check the layout against transformer-engine's own rule instead."""
import pytest
import torch

from megarl.data.batch import Batch
from megarl.engines.megatron.context_parallel import thd_positions_of_rank
from megarl.engines.megatron.sequences import fixed_shape, length_multiple, make_micro_batch, thd_filler

CPU = torch.device("cpu")


def te_2_11_pad_between_seqs(params) -> bool:
    """transformer-engine 2.11's decision, as it writes it (pytorch/attention/dot_product_attention/
    dot_product_attention.py, DotProductAttention.forward, qkv_format "thd" and pad_between_seqs None,
    which megatron-core 0.16.1 always leaves it). When False its p2p CP attention cuts each rank's
    sequences at cu_seqlens_q // cp_size (context_parallel.py, cp_p2p_fwd_prepare_qkv)."""
    return (
        params.cu_seqlens_q_padded is not None
        and not torch.equal(params.cu_seqlens_q_padded[:-1], params.cu_seqlens_q[:-1])
    ) or (
        params.cu_seqlens_kv_padded is not None
        and not torch.equal(params.cu_seqlens_kv_padded[:-1], params.cu_seqlens_kv[:-1])
    )


def _samples(lengths):
    """A batch of samples of `lengths` tokens: 2 prompt tokens, the rest response."""
    return Batch.from_token_lists([[10 + i, 20 + i] for i in range(len(lengths))],
                                  [[(3 * i + j) % 40 + 1 for j in range(n - 2)] for i, n in enumerate(lengths)])


@pytest.mark.parametrize("cu, cu_padded, cp, multiple, expected", [
    ([0, 8], [0, 8], 2, 4, 0),  # one sample, no padding anywhere
    ([0, 4, 12], [0, 4, 12], 2, 4, 0),  # several samples, no padding anywhere
    ([0, 5, 9], [0, 8, 12], 2, 4, 0),  # padding between sequences only: transformer-engine sees it
    ([0, 5], [0, 8], 2, 4, 4),  # padding on the last (only) sequence: a filler of 2 CP tokens
    ([0, 5], [0, 8], 4, 8, 8),
    ([0, 4, 9], [0, 4, 12], 2, 4, 4),  # several samples, padding on the last one only
    ([0, 5, 10], [0, 8, 16], 4, 8, 8),  # between sequences and on the last one
    ([0, 5], [0, 8], 2, 8, 8),  # sequence parallelism at TP4: the multiple is lcm(2 CP, CP x TP) = 8
    ([0, 5], [0, 5], 1, 1, 0),  # CP 1: transformer-engine gets no cu_seqlens_padded
])
def test_a_filler_follows_a_last_sequence_that_ends_in_padding(cu, cu_padded, cp, multiple, expected):
    assert thd_filler(cu, cu_padded, cp, multiple) == expected
    as_tensors = [torch.tensor(c, dtype=torch.int32) for c in (cu, cu_padded)]  # as `pack` gives them
    assert thd_filler(*as_tensors, cp, multiple) == expected


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", [[5], [13], [16], [5, 9], [9, 5], [8, 16], [5, 8], [8, 5], [3, 11, 7]])
def test_transformer_engine_2_11_sees_padding_wherever_a_sequence_has_some(cp, lengths):
    """On every packed micro-batch megarl makes (with and without a fixed shape), transformer-engine
    2.11 decides "padding between sequences" whenever a real sequence has padding; otherwise no
    sequence has any, so its cu_seqlens_q // cp_size cut is the padded one."""
    batch, multiple = _samples(lengths), length_multiple(1, False, cp)
    rows = list(range(len(lengths)))
    whole = fixed_shape(batch, [rows], "packed", multiple, cp)
    for shape in (None, whole, (1, whole[1] + multiple)):
        mb = make_micro_batch(batch, rows, "packed", 47, CPU, shape=shape, multiple=multiple, cp=cp)
        params = mb.packed_seq_params
        cu, cu_padded = params.cu_seqlens_q, params.cu_seqlens_q_padded
        n = len(lengths)
        padded = bool((cu_padded[1:n + 1] - cu_padded[:n] > cu[1:n + 1] - cu[:n]).any())
        assert padded == any(length % (2 * cp) for length in lengths)
        if padded:
            assert te_2_11_pad_between_seqs(params), (lengths, shape, cu.tolist(), cu_padded.tolist())
        else:
            assert torch.equal(cu, cu_padded)


@pytest.mark.parametrize("cp, cu, cu_padded", [(2, [0, 13, 17], [0, 16, 20]), (4, [0, 13, 21], [0, 16, 24])])
def test_one_long_sample_of_a_length_not_a_multiple_of_2cp(cp, cu, cu_padded):
    """13 tokens padded to 16, then a filler of 2 CP tokens (never scored); each CP rank holds its
    two chunks of both, and the response tokens are scored as without CP."""
    batch = _samples([13])
    multiple = length_multiple(1, False, cp)
    whole = make_micro_batch(batch, [0], "packed", 47, CPU)
    ids = torch.zeros(cu_padded[-1], dtype=torch.long)
    ids[:13] = whole.input_ids[0]
    parts = [make_micro_batch(batch, [0], "packed", 47, CPU, multiple=multiple, cp=cp, cp_rank=r) for r in range(cp)]
    for r, mb in enumerate(parts):
        params = mb.packed_seq_params
        assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == cu
        assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == cu_padded
        assert te_2_11_pad_between_seqs(params)
        held = thd_positions_of_rank(torch.tensor(cu_padded), cp, r)
        assert mb.held_rows.tolist() == held.tolist()
        assert torch.equal(mb.input_ids[0], ids[held])
        assert torch.equal(mb.targets, whole.targets[mb.cp.slots[r]])
    assert sorted(torch.cat(parts[0].cp.slots).tolist()) == list(range(11))
    # a length that is a multiple of 2 CP needs no filler
    exact = make_micro_batch(_samples([16]), [0], "packed", 47, CPU, multiple=multiple, cp=cp, cp_rank=0)
    params = exact.packed_seq_params
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_q.tolist() == [0, 16]
    assert not te_2_11_pad_between_seqs(params)  # nothing padded: its cu_seqlens_q // cp_size cut is right


def test_a_fixed_shape_holds_the_filler_and_a_shape_without_room_for_it_is_refused():
    batch = _samples([13, 16])
    assert fixed_shape(batch, [[0], [1]], "packed", 4, 2) == (1, 20)  # 13 -> 16 + a filler of 4; 16 alone
    with pytest.raises(ValueError, match="a packed micro-batch of 16 tokens and a filler of at least 4 does not fit"):
        make_micro_batch(batch, [0], "packed", 47, CPU, shape=(1, 16), multiple=4, cp=2)
