"""Check 9 of tools/gpu_check.py: transformer-engine's THD decision on megarl's packed micro-batch.

One sample of 5 tokens, packed at context parallelism 2 (`sequences.make_micro_batch`): megarl pads
the sequence to 8 tokens (a multiple of 2 CP, `length_multiple`), so cu_seqlens [0, 5] and
cu_seqlens_padded [0, 8], and, as the last sequence ends in padding, appends a filler sequence of 4
tokens (`sequences.thd_filler`): [0, 5, 9] and [0, 8, 12]. transformer-engine decides from these
whether there is padding between sequences (`te_pad_between_seqs`); if it decided no, its CP attention
would cut each rank's part at cu_seqlens // cp, not at the padded offsets. The check:

  - the decision, everywhere (CPU too): megarl's cu_seqlens (as megatron-core 0.16.1 hands them to TE,
    every `PackedSeqParams` field but cp_group / local_cp_size: extensions/transformer_engine.py,
    TEDotProductAttention.forward) make TE's rule say True on every CP rank; without the filler it
    would say False (the rule is blind to the last sequence's padding);
  - with transformer-engine on a GPU: TE's own `DotProductAttention` (THD, `padding_causal` as megatron
    asks for THD, one GPU so CP 1) on those cu_seqlens, bfloat16; its output on each sequence's real
    rows must equal a plain causal attention of that sequence (float32, same inputs) within 3e-2
    (bfloat16 rounding of outputs of magnitude ~1). Without a GPU or without TE it says why it skipped.

    PYTHONPATH=src python tools/gpu_check_thd.py [--cpu]    # this check alone (gpu_check.py runs it as check 9)
"""
from __future__ import annotations

import argparse
import sys

import torch

SAMPLE = ([1, 2, 3], [4, 5])  # prompt, response: 5 tokens
CP = 2
TE_TOLERANCE = 3e-2


def te_pad_between_seqs(cu_q: torch.Tensor, cu_kv: torch.Tensor, cu_q_padded, cu_kv_padded) -> bool:
    """transformer-engine 2.11's decision when the caller passes no `pad_between_seqs` (megatron-core
    0.16.1 never does): pytorch/attention/dot_product_attention/dot_product_attention.py,
    DotProductAttention.forward, "check if there is padding between sequences when qkv_format='thd'"."""
    return bool((cu_q_padded is not None and not torch.equal(cu_q_padded[:-1], cu_q[:-1]))
                or (cu_kv_padded is not None and not torch.equal(cu_kv_padded[:-1], cu_kv[:-1])))


def real_rows(cu: torch.Tensor, cu_padded: torch.Tensor) -> torch.Tensor:
    """The rows of a THD tensor that hold a sequence's real tokens (not the padding after each)."""
    return torch.cat([torch.arange(int(cu_padded[i]), int(cu_padded[i]) + int(cu[i + 1] - cu[i]))
                      for i in range(len(cu) - 1)])


def reference_attention(q, k, v, cu: torch.Tensor, cu_padded: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v within each sequence's real rows, float32; [T, H, D] in and out
    (padding rows 0)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i in range(len(cu) - 1):
        rows = slice(int(cu_padded[i]), int(cu_padded[i]) + int(cu[i + 1] - cu[i]))
        qs, ks, vs = (x[rows].float().transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        scores = qs @ ks.transpose(1, 2) / q.shape[-1] ** 0.5
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out[rows] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def te_attention(params) -> dict:
    """TE's DotProductAttention on `params` (megarl's PackedSeqParams) on this GPU, against the reference."""
    import transformer_engine
    from transformer_engine.pytorch import DotProductAttention

    heads, dim = 4, 64
    kwargs = {key: getattr(params, key) for key in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv",
                                                    "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                                                    "max_seqlen_q", "max_seqlen_kv")}
    kwargs.update({key: kwargs[key].cuda() for key in kwargs if key.startswith("cu_")})
    total = int(params.cu_seqlens_q_padded[-1])
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attention = DotProductAttention(heads, dim, qkv_format="thd", attn_mask_type="padding_causal")
    with torch.no_grad():
        out = attention(q, k, v, attn_mask_type="padding_causal", **kwargs).float().view(total, heads, dim)
    reference = reference_attention(q, k, v, params.cu_seqlens_q, params.cu_seqlens_q_padded)
    rows = real_rows(params.cu_seqlens_q, params.cu_seqlens_q_padded).cuda()
    diff = (out[rows] - reference[rows]).abs().max().item()
    return {"transformer_engine": transformer_engine.__version__, "gpu": torch.cuda.get_device_name(),
            "rows_checked": rows.tolist(), "max_abs_vs_reference": diff, "pass": diff <= TE_TOLERANCE}


def check_thd_decision(cpu: bool) -> dict:
    from megarl.data.batch import Batch
    from megarl.engines.megatron.sequences import length_multiple, make_micro_batch

    batch = Batch.from_token_lists([SAMPLE[0]], [SAMPLE[1]])
    multiple = length_multiple(tp=1, sequence_parallel=False, cp=CP)
    ranks = [make_micro_batch(batch, [0], "packed", 47, torch.device("cpu"), multiple=multiple, cp=CP, cp_rank=r)
             .packed_seq_params for r in range(CP)]
    p = ranks[0]
    cu, cu_padded = p.cu_seqlens_q, p.cu_seqlens_q_padded
    decisions = [te_pad_between_seqs(r.cu_seqlens_q, r.cu_seqlens_kv, r.cu_seqlens_q_padded, r.cu_seqlens_kv_padded)
                 for r in ranks]
    without_filler = te_pad_between_seqs(cu[:-1], cu[:-1], cu_padded[:-1], cu_padded[:-1])
    decided = cu.tolist() == [0, 5, 9] and cu_padded.tolist() == [0, 8, 12] and all(decisions) and not without_filler
    result = {"cu_seqlens": cu.tolist(), "cu_seqlens_padded": cu_padded.tolist(), "max_seqlen": p.max_seqlen_q,
              "te_pad_between_seqs_per_cp_rank": decisions, "te_pad_between_seqs_without_the_filler": without_filler}
    if cpu or not torch.cuda.is_available():
        result["te_attention"] = "skipped: no GPU (TE's attention runs on CUDA only)"
    else:
        try:
            import transformer_engine  # noqa: F401
        except ImportError as e:
            result["te_attention"] = f"skipped: transformer_engine does not import ({type(e).__name__}: {e})"
        else:
            result["te_attention"] = te_attention(p)
    te = result["te_attention"]
    result["pass"] = decided and (isinstance(te, str) or te["pass"])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the decision only, even where a GPU is")
    result = check_thd_decision(p.parse_args().cpu)
    for key, value in result.items():
        print(f"  {key}: {value}")
    print(f"--- TE's THD decision on megarl's packed micro-batch: {'PASS' if result['pass'] else 'FAIL'}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
