"""The pure parts of context parallelism (no process group): megatron's chunk layout, which CP rank
scores which response token, the micro-batch a CP rank gets, the rows its MoE routers see, and the
device decisions (the core attention, the sequence layout)."""
import pytest
import torch

from megarl.data.batch import Batch
from megarl.engines.megatron.context_parallel import positions_of_rank, split_tokens
from megarl.engines.megatron.model import context_parallel_attention
from megarl.engines.megatron.replay import router_rows
from megarl.engines.megatron.sequences import default_sequence_layout, length_multiple, make_micro_batch

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


def test_split_tokens_sends_each_token_to_the_rank_holding_its_position():
    # two sequences (b = 2) of S = 8 at CP2; tokens read at positions 1, 2, 6 of sequence 0 and 7 of sequence 1
    at, sample = torch.tensor([1, 2, 6, 7]), torch.tensor([0, 0, 0, 1])
    tokens, rows = split_tokens(at, sample, 8, 2, 2, 0)
    assert [s.tolist() for s in tokens.slots] == [[0, 2, 3], [1]] and tokens.total == 4
    # rank 0 holds positions [0, 1, 6, 7] -> local indices 1, 2, 3; rows s * b + j
    assert rows.tolist() == [1 * 2 + 0, 2 * 2 + 0, 3 * 2 + 1]
    _, rows1 = split_tokens(at, sample, 8, 2, 2, 1)
    assert rows1.tolist() == [0 * 2 + 0]  # position 2 is rank 1's local 0


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
    with pytest.raises(ValueError, match="context parallelism takes the padded sequence layout"):
        make_micro_batch(batch, [0, 1], "packed", 47, CPU, cp=2)


def test_router_rows_follow_the_cp_positions_then_the_sequence_parallel_split():
    held = torch.tensor([0, 1, 6, 7, 8, 9, 14, 15])  # CP rank 0 of [S=8, b=2]: positions 0, 1, 6, 7
    assert router_rows(16, 2, 0, False, held).tolist() == held.tolist()
    assert router_rows(16, 2, 1, True, held).tolist() == [8, 9, 14, 15]  # TP rank 1's half of them
    assert router_rows(6, 2, 0, False).tolist() == list(range(6))


@pytest.mark.parametrize("cp, on_cuda, te, expected", [
    (1, False, False, "spec"),  # no CP: megatron's local attention
    (1, True, False, "spec"),
    (2, True, True, "spec"),  # transformer-engine's attention runs CP (cp_comm_type)
    (2, False, False, "cpu_reference"),  # megatron's local attention refuses CP: megarl's CPU stand-in
    (2, True, False, None),  # a GPU without transformer-engine layers (LoRA, or TE not installed): refused
])
def test_the_core_attention_of_a_cp_role(cp, on_cuda, te, expected):
    assert context_parallel_attention(cp, on_cuda=on_cuda, transformer_engine_layers=te) == expected


def test_context_parallel_roles_take_the_padded_layout():
    assert default_sequence_layout(True, 1) == "packed"
    assert default_sequence_layout(True, 2) == "padded"
    assert default_sequence_layout(False, 1) == "padded"
