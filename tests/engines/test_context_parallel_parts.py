"""The pure parts of context parallelism (no process group): megatron's chunk layout, padded and
packed (THD), which CP rank scores which response token, the micro-batch a CP rank gets, the rows
its MoE routers see, and the device decisions (the core attention, the sequence layout)."""
import pytest
import torch

from megarl.data.batch import Batch
from megarl.engines.megatron.context_parallel import positions_of_rank, split_tokens, thd_positions_of_rank
from megarl.engines.megatron.model import core_attention_choice
from megarl.engines.megatron.sequences import (default_sequence_layout, fixed_shape, length_multiple, make_micro_batch,
                                               sequence_layout_problems)

CPU = torch.device("cpu")


def test_each_cp_rank_holds_chunk_r_and_chunk_2cp_minus_1_minus_r():
    # 8 positions, CP2: chunks [0 1] [2 3] [4 5] [6 7]; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert positions_of_rank(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert positions_of_rank(8, 2, 1).tolist() == [2, 3, 4, 5]
    # CP4 over 16: rank r holds chunk r and chunk 7 - r; together every position once
    held = [positions_of_rank(16, 4, r).tolist() for r in range(4)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(sum(held, [])) == list(range(16))
    assert positions_of_rank(5, 1, 0).tolist() == list(range(5))
    with pytest.raises(ValueError, match="6 positions cannot be cut into 2 x 2"):
        positions_of_rank(6, 2, 0)


def test_sequences_are_padded_to_2cp_and_with_sequence_parallelism_to_cp_tp():
    assert [length_multiple(1, False, cp) for cp in (1, 2, 4)] == [1, 4, 8]
    assert length_multiple(2, True, 2) == 4  # S/CP = 2k splits over TP2
    assert length_multiple(4, True, 2) == 8  # S/CP a multiple of 4
    assert length_multiple(3, True, 2) == 12  # lcm(4, 6)


def test_packed_sequences_are_cut_one_sequence_at_a_time_as_transformer_engines_example():
    # transformer-engine's attn_forward_func_with_cp docstring: seq_lens [8, 4], cp_size 2 -> GPU0 holds
    # sequence 0's positions 0 1 6 7 and sequence 1's 0 3; GPU1 sequence 0's 2 3 4 5 and sequence 1's 1 2
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert thd_positions_of_rank(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert thd_positions_of_rank(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert thd_positions_of_rank(cu, 1, 0).tolist() == list(range(12))
    with pytest.raises(ValueError, match="packed sequence 1 of 6 positions cannot be cut into 2 x 2"):
        thd_positions_of_rank(torch.tensor([0, 8, 14]), 2, 0)


def test_split_tokens_sends_each_token_to_the_rank_holding_its_row():
    # two sequences (b = 2) of S = 8 at CP2; tokens read at positions 1, 2, 6 of sequence 0 and 7 of sequence 1
    held = [(positions_of_rank(8, 2, r)[:, None] * 2 + torch.arange(2)).reshape(-1) for r in range(2)]
    rows = torch.tensor([1 * 2 + 0, 2 * 2 + 0, 6 * 2 + 0, 7 * 2 + 1])
    tokens, local = split_tokens(rows, held, 0)
    assert [s.tolist() for s in tokens.slots] == [[0, 2, 3], [1]] and tokens.total == 4
    # rank 0 holds positions [0, 1, 6, 7] -> local indices 1, 2, 3; rows s * b + j
    assert local.tolist() == [1 * 2 + 0, 2 * 2 + 0, 3 * 2 + 1]
    _, local1 = split_tokens(rows, held, 1)
    assert local1.tolist() == [0 * 2 + 0]  # position 2 is rank 1's local 0


def test_a_cp_ranks_micro_batch_holds_its_positions_and_the_tokens_predicted_there():
    """Samples of 5 and 4 tokens at CP2: padded to 8, rank r gets columns positions_of_rank(8, 2, r);
    each response token is scored on the rank holding the position before it, and the two ranks'
    tokens together are every target once, at the same hidden state as without CP."""
    batch = Batch.from_token_lists([[11, 12, 13], [21]], [[14, 15], [22, 23, 24]])
    whole = make_micro_batch(batch, [0, 1], "padded", 47, CPU, multiple=4)
    parts = [make_micro_batch(batch, [0, 1], "padded", 47, CPU, multiple=4, cp=2, cp_rank=r) for r in range(2)]
    assert whole.input_ids.shape == (2, 8)
    for r, mb in enumerate(parts):
        held = positions_of_rank(8, 2, r)
        assert torch.equal(mb.input_ids, whole.input_ids[:, held])
        assert torch.equal(mb.position_ids, whole.position_ids[:, held])
        assert mb.held_rows.tolist() == (held[:, None] * 2 + torch.arange(2)).reshape(-1).tolist()
        # this rank's hidden row of each of its tokens is, in the whole sequence, the row without CP
        assert torch.equal(mb.held_rows[mb.token_index], whole.token_index[mb.cp.slots[r]])
        assert torch.equal(mb.targets, whole.targets[mb.cp.slots[r]])
        assert mb.num_tokens == whole.num_tokens == 5
    assert sorted(torch.cat(parts[0].cp.slots).tolist()) == list(range(5))


def test_a_cp_ranks_packed_micro_batch_holds_two_chunks_of_every_sequence():
    """Samples of 5 and 4 tokens, packed at CP2: padded to 8 and 4 (cu_seqlens_padded [0, 8, 12], the
    real lengths in cu_seqlens), rank r holds chunks r and 3 - r of each; each response token is
    scored on the rank holding the row before it, at that row of the whole packed sequence."""
    from megarl.engines.megatron.cp_attention import thd_row_positions

    batch = Batch.from_token_lists([[11, 12, 13], [21]], [[14, 15], [22, 23, 24]])
    whole = make_micro_batch(batch, [0, 1], "packed", 47, CPU)
    assert whole.input_ids.tolist() == [[11, 12, 13, 14, 15, 21, 22, 23, 24]]
    parts = [make_micro_batch(batch, [0, 1], "packed", 47, CPU, multiple=4, cp=2, cp_rank=r) for r in range(2)]
    padded_ids = [11, 12, 13, 14, 15, 0, 0, 0, 21, 22, 23, 24]
    assert parts[0].input_ids.tolist() == [[11, 12, 0, 0, 21, 24]]  # chunks 0 and 3 of each sequence
    assert parts[1].input_ids.tolist() == [[13, 14, 15, 0, 22, 23]]  # chunks 1 and 2
    params = parts[0].packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 5, 9] and params.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    assert params.max_seqlen_q == 8
    assert parts[1].position_ids.tolist() == [[2, 3, 4, 5, 1, 2]]  # positions within each sequence
    assert parts[0].sequence_starts.tolist() == [0, 8]
    cu = torch.tensor([0, 8, 12])
    for r, mb in enumerate(parts):
        assert mb.held_rows.tolist() == thd_positions_of_rank(cu, 2, r).tolist()
        sequence, position = thd_row_positions(cu, mb.held_rows[mb.token_index])
        assert [padded_ids[int(cu[s]) + int(p) + 1] for s, p in zip(sequence, position)] == mb.targets.tolist()
        assert torch.equal(mb.targets, whole.targets[mb.cp.slots[r]])
        assert mb.num_tokens == whole.num_tokens == 5
    assert sorted(torch.cat(parts[0].cp.slots).tolist()) == list(range(5))
    # a fixed shape (VPP): each sequence padded to 2 CP first, then one filler sequence
    three = Batch.from_token_lists([[11, 12, 13], [21], [31]], [[14, 15], [22, 23, 24], [32, 33]])
    assert fixed_shape(three, [[0, 1, 2]], "packed", 4, 2) == (1, 20)  # 8 + 4 + 4, and 4 of filler (3 -> 4: thd_filler)
    assert fixed_shape(three, [[0, 1, 2]], "packed", 4) == (1, 12)  # without CP: 12 tokens in all
    filled = make_micro_batch(batch, [0, 1], "packed", 47, CPU, shape=(1, 20), multiple=4, cp=2, cp_rank=0)
    assert filled.packed_seq_params.cu_seqlens_q_padded.tolist() == [0, 8, 12, 20]
    assert filled.packed_seq_params.cu_seqlens_q.tolist() == [0, 5, 9, 17]
    assert filled.input_ids.shape == (1, 10)


@pytest.mark.parametrize("cp, packed, on_cuda, te, expected", [
    (1, False, False, False, "cpu_reference"),  # no CP, padded, CPU: megarl's, through torch's fused kernel
    (1, False, True, False, "spec"),  # ... on a GPU: megatron's local attention
    (2, False, True, True, "spec"),  # transformer-engine's attention runs CP (cp_comm_type)
    (1, True, True, True, "spec"),  # and packed sequences
    (2, True, True, True, "spec"),
    (2, False, False, False, "cpu_reference"),  # megatron's local attention refuses CP: megarl's CPU stand-in
    (1, True, False, False, "cpu_reference"),  # ... and packed sequences
    (2, True, False, False, "cpu_reference"),
    (2, False, True, False, None),  # a GPU without transformer-engine layers (LoRA, or TE not installed): refused
    (1, True, True, False, None),
])
def test_the_core_attention_of_a_role(cp, packed, on_cuda, te, expected):
    assert core_attention_choice(cp, packed=packed, on_cuda=on_cuda, transformer_engine_layers=te) == expected


@pytest.mark.parametrize("on_cuda, te, expected", [
    (False, False, "cpu_reference"),  # megatron's local attention takes no k_channels / v_channels: megarl's
    (True, False, None),  # a GPU with local layers: refused
    (True, True, "spec"),  # transformer-engine's attention takes them
])
def test_the_core_attention_of_multi_latent_attention(on_cuda, te, expected):
    assert core_attention_choice(1, packed=False, on_cuda=on_cuda, transformer_engine_layers=te, mla=True) == expected


def _where(cp=1, comm=None, on_cuda=True, te=True):
    return dict(section="actor_rollout_ref.actor", cp=cp, cp_comm_type=comm, on_cuda=on_cuda,
                transformer_engine_layers=te)


def test_packed_sequences_where_transformer_engine_takes_them():
    assert default_sequence_layout(**_where()) == "packed"
    assert default_sequence_layout(**_where(cp=2)) == "packed"  # p2p, the default cp_comm_type, takes THD
    assert default_sequence_layout(**_where(cp=2, comm="p2p")) == "packed"
    assert default_sequence_layout(**_where(cp=2, comm="a2a")) == "padded"  # its a2a and all-gather refuse THD
    assert default_sequence_layout(**_where(cp=2, comm=["p2p", "all_gather"])) == "padded"
    assert default_sequence_layout(**_where(comm="a2a")) == "packed"  # no CP: cp_comm_type is not used
    assert default_sequence_layout(**_where(te=False)) == "padded"
    assert default_sequence_layout(**_where(on_cuda=False, te=False)) == "padded"  # CPU: megatron's own attention


def test_a_packed_layout_transformer_engine_refuses_is_refused_naming_the_keys():
    assert sequence_layout_problems("packed", **_where(cp=2)) == []
    assert sequence_layout_problems("packed", **_where(cp=2, on_cuda=False, te=False)) == []  # the CPU reference
    assert sequence_layout_problems("padded", **_where(cp=2, comm="a2a", te=False)) == []
    assert sequence_layout_problems("packed", **_where(cp=2, comm="all_gather", on_cuda=False, te=False)) == [
        "actor_rollout_ref.actor.megatron.override_transformer_config.cp_comm_type=all_gather with "
        "context_parallel_size=2: transformer-engine's all_gather context-parallel attention refuses packed (THD) "
        "sequences; use p2p, or the padded sequence layout"]
    assert sequence_layout_problems("packed", **_where(te=False)) == [
        "actor_rollout_ref.actor: packed sequences need transformer-engine attention on a GPU (megatron's local "
        "attention refuses PackedSeqParams); install transformer-engine, or take the padded layout"]
    assert sequence_layout_problems("thd", **_where()) == [
        "actor_rollout_ref.actor: unknown sequence layout 'thd'; choose 'padded' or 'packed'"]
