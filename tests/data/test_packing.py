"""Sequence packing: every real token exactly once, in order; per-token values map back."""
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from megarl.data.batch import Batch
from megarl.data.packing import pack, pack_response, unpack_response


def random_batch(seed, n=6, vocab=40):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    responses = [[rng.randrange(1, vocab) for _ in range(rng.randint(0, 9))] for _ in range(n)]
    return Batch.from_token_lists(prompts, responses), prompts, responses


@pytest.mark.parametrize("multiple", [1, 4])
def test_every_token_exactly_once_in_order(multiple):
    batch, prompts, responses = random_batch(0)
    packed = pack(batch, pad_to_multiple_of=multiple)
    real_lens = [len(p) + len(r) for p, r in zip(prompts, responses)]
    padded_lens = [-(-n // multiple) * multiple for n in real_lens]
    assert packed.cu_seqlens.tolist() == [0] + list(torch.tensor(real_lens).cumsum(0).tolist())
    assert packed.cu_seqlens_padded.tolist() == [0] + list(torch.tensor(padded_lens).cumsum(0).tolist())
    assert packed.cu_seqlens.dtype == torch.int32 and packed.num_tokens == sum(padded_lens)
    assert packed.max_seqlen == max(padded_lens)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = int(packed.cu_seqlens_padded[i])
        assert packed.input_ids[start : start + len(p) + len(r)].tolist() == p + r
        assert packed.input_ids[start + len(p) + len(r) : start + padded_lens[i]].eq(0).all()
        assert packed.position_ids[start : start + padded_lens[i]].tolist() == list(range(padded_lens[i]))
    assert packed.prompt_lens.tolist() == [len(p) for p in prompts]
    assert packed.response_lens.tolist() == [len(r) for r in responses]


@pytest.mark.parametrize("shift", [0, -1])
def test_response_values_round_trip(shift):
    batch, _, _ = random_batch(1)
    packed = pack(batch, pad_to_multiple_of=3)
    values = torch.randn(len(batch), batch.response_length, 2) * batch["response_mask"][..., None]
    flat = pack_response(values, packed, shift=shift)
    assert flat.shape == (packed.num_tokens, 2)
    assert int((flat != 0).any(-1).sum()) == int(batch["response_mask"].sum())  # each response token once
    assert torch.equal(unpack_response(flat, packed, shift=shift), values)


def test_next_token_log_probs_of_a_real_model_match_the_padded_computation():
    """Packed per-token log-probs (from the logits at t, for token t+1) unpacked with shift=-1
    equal the usual padded-batch response log-probs."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = Qwen2ForCausalLM(config).eval()
    batch, prompts, responses = random_batch(2, n=4)
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        width, plen = batch.response_length, batch["prompt_ids"].shape[1]
        expected = F.log_softmax(logits[:, plen - 1 : plen + width - 1], -1)
        expected = expected.gather(-1, batch["response_ids"][..., None])[..., 0] * batch["response_mask"]

        packed = pack(batch)
        per_sequence = [model(input_ids=torch.tensor([p + r])).logits[0] for p, r in zip(prompts, responses)]
        packed_logits = torch.cat(per_sequence)  # what a varlen (cu_seqlens) forward returns
        labels = torch.roll(packed.input_ids, -1)
        token_log_probs = F.log_softmax(packed_logits, -1).gather(-1, labels[:, None])[:, 0]
        got = unpack_response(token_log_probs, packed, shift=-1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_masks_with_gaps_are_refused():
    batch, _, _ = random_batch(3)
    mask = batch["response_mask"].clone()
    row = int(mask.sum(1).argmax())
    mask[row, 0] = 0
    batch["response_mask"] = mask
    with pytest.raises(ValueError, match=f"response_mask of sample {row} has a gap"):
        pack(batch)


def test_shift_needs_a_prompt_token():
    batch = Batch.from_token_lists([[]], [[4, 5]])
    with pytest.raises(ValueError, match="shift=-1 needs at least one prompt token"):
        unpack_response(torch.zeros(2), pack(batch), shift=-1)
