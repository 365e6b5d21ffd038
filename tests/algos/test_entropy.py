"""Entropy from logits, full vocabulary and vocabulary-parallel shards."""
import math

import pytest
import torch

from megarl.algos.entropy import entropy_from_logits, vocab_parallel_entropy_partial


def test_by_hand():
    logits = torch.tensor([[0.0, 0.0], [0.0, -float("inf")], [1000.0, 1000.0], [0.0, math.log(3.0)]])
    got = entropy_from_logits(logits).tolist()
    # [1/2, 1/2] -> ln 2; [1, 0] -> 0; huge equal logits -> ln 2; [1/4, 3/4]
    assert got == pytest.approx([math.log(2), 0.0, math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])


def test_matches_categorical_and_handles_bf16():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=gen, dtype=torch.float64) * 4
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-12)
    low = entropy_from_logits(logits.to(torch.bfloat16))
    assert low.dtype == torch.float32
    assert torch.allclose(low.double(), expected, atol=0.1)


def test_vocab_parallel_shards_sum_to_the_full_entropy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 7, 64, generator=gen, dtype=torch.float64) * 5
    logits[0, 0, 3] = -float("inf")
    shards = logits.chunk(4, dim=-1)
    # the reductions a tensor-parallel caller does with all_reduce(MAX) and all_reduce(SUM)
    global_max = torch.stack([s.amax(-1) for s in shards]).amax(0)
    shifted = [s - global_max[..., None] for s in shards]
    lse = sum(torch.exp(s).sum(-1) for s in shifted).log()
    entropy = sum(vocab_parallel_entropy_partial(s, lse) for s in shifted)
    assert torch.allclose(entropy, entropy_from_logits(logits), atol=1e-12)


def test_gradient_is_finite_and_correct():
    logits = torch.tensor([[2.0, -1.0, 0.5, -float("inf")]], dtype=torch.float64, requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    finite = logits.detach()[:, :3]
    p = torch.softmax(finite, -1)
    expected = -p * (finite.log_softmax(-1) + entropy_from_logits(finite)[:, None])  # dH/dz = -p (log p + H)
    assert torch.allclose(logits.grad[:, :3], expected, atol=1e-12)
    assert logits.grad[0, 3] == 0
