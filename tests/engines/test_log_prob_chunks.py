"""The log-prob head (`engines.megatron.heads.token_log_probs`) over its logits in one small chunk
(kept, not recomputed: `KEPT_LOGITS_ELEMENTS`) and in several (each recomputed in the backward
pass): log-probs, entropies and their gradients against plain PyTorch's log_softmax over the whole
logits (megatron's parallel state at TP=1 on gloo, one rank; the vocabulary padded past its real
size as megatron pads it)."""
import torch

from megarl.testing import run_gloo_workers

N, H, VOCAB, PADDED, TEMPERATURE = 37, 8, 50, 64, 0.7


def inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g)
    weight[VOCAB:] = 0  # megatron's padded rows
    targets = torch.randint(0, VOCAB, (N,), generator=g)
    return hidden, weight, targets, torch.randn(N, generator=g), torch.randn(N, generator=g)


def heads_world(rank: int, world_size: int, port: int) -> dict:
    """{chunk_elements: (log-probs, entropies, d loss/d hidden, d loss/d weight)} from the head."""
    from megarl.engines.megatron.heads import token_log_probs
    from megarl.testing import init_gloo_model_parallel

    init_gloo_model_parallel(rank, world_size, port)
    hidden, weight, targets, c1, c2 = inputs()
    out = {}
    for chunk_elements in (1 << 26, 5 * PADDED):  # one chunk; eight chunks of 5 tokens (the last of 2)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = token_log_probs(h, w, targets, vocab_size=VOCAB, temperature=TEMPERATURE, with_entropy=True,
                                  chunk_elements=chunk_elements)
        grads = torch.autograd.grad((lp * c1).sum() + (ent * c2).sum(), [h, w])
        out[chunk_elements] = (lp.detach(), ent.detach(), *grads)
    return out


def test_one_chunk_and_checkpointed_chunks_give_plain_pytorchs_values_and_gradients():
    from megarl.engines.megatron.heads import KEPT_LOGITS_ELEMENTS

    assert N * PADDED <= KEPT_LOGITS_ELEMENTS  # the one chunk is kept, not recomputed
    (result,) = run_gloo_workers(heads_world, 1, timeout_s=120)
    hidden, weight, targets, c1, c2 = inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_p = torch.log_softmax(h @ w[:VOCAB].t() / TEMPERATURE, -1)
    lp, ent = log_p.gather(1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
    expected = (lp.detach(), ent.detach(), *torch.autograd.grad((lp * c1).sum() + (ent * c2).sum(), [h, w]))
    assert len(result) == 2
    for chunk_elements, got in result.items():
        for name, g, e in zip(("log_probs", "entropy", "grad hidden", "grad weight"), got, expected):
            at = f"chunk_elements {chunk_elements}, {name}"
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m, at=at: f"{at}: {m}")
