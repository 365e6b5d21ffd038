"""HF on-disk expert names -> transformers 5's fused in-memory expert tensors (the CPU engine's
weight updates). transformers 5 holds a layer's experts as `mlp.experts.gate_up_proj`
[experts, 2 x ffn, hidden] (each expert's gate rows, then its up rows: `Qwen3MoeExperts.forward`
chunks the product in two, gate first) and `mlp.experts.down_proj` [experts, hidden, ffn], while
checkpoints, `save_pretrained` and weight pushes name every expert
(`mlp.experts.<e>.gate_proj.weight`; Mixtral `block_sparse_moe.experts.<e>.w1/w3/w2.weight` and
`block_sparse_moe.gate.weight`, held as `mlp.*`)."""
from __future__ import annotations

import re
from typing import Optional

_EXPERT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_GATE = re.compile(r"^(.*)\.block_sparse_moe\.gate\.weight$")
_GATE, _UP = ("gate_proj", "w1"), ("up_proj", "w3")


def memory_slot(name: str, targets: dict) -> Optional[tuple[str, tuple]]:
    """(in-memory parameter name, index into it) that holds the on-disk tensor `name`, or None
    when `targets` (the model's state dict) has no such place."""
    gate = _MIXTRAL_GATE.match(name)
    if gate and f"{gate[1]}.mlp.gate.weight" in targets:
        return f"{gate[1]}.mlp.gate.weight", ()
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, part = match[1], int(match[2]), match[3]
    fused = f"{prefix}.mlp.experts.{'down_proj' if part in ('down_proj', 'w2') else 'gate_up_proj'}"
    if fused not in targets or expert >= targets[fused].shape[0]:
        return None
    if part in _GATE + _UP:
        ffn = targets[fused].shape[1] // 2
        return fused, (expert, slice(0, ffn) if part in _GATE else slice(ffn, 2 * ffn))
    return fused, (expert,)
