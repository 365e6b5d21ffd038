"""The grouped-GEMM spelling of MoE expert weights, translated to the sequential one at the bridge's door.

megatron-core builds a layer's experts as `SequentialMLP` (one `MLP` per local expert:
`mlp.experts.local_experts.<k>.linear_fc1.weight`) or, with `moe_grouped_gemm` and the
transformer-engine spec, as `TEGroupedMLP`, whose `TEColumnParallelGroupedLinear` /
`TERowParallelGroupedLinear` are transformer-engine `GroupedLinear`s holding one parameter per
local expert: `mlp.experts.linear_fc1.weight<k>` (and `bias<k>` with `add_bias_linear`, which
megarl's models never have). Read in megatron-core 0.16.1 and 0.19.2, transformer-engine 2.11:

- names and shapes: TE `GroupedLinear.__init__` registers `weight{i}` of shape [out, in] per GEMM
  (TE 2.11 `pytorch/module/grouped_linear.py:668-700`); megatron gives it `out = 2F / ETP` (fc1,
  GLU) and `in = F / ETP` (fc2) per rank whenever EP > 1 or ETP > 1 (`explicit_expert_comm`,
  0.16.1 `extensions/transformer_engine.py:1521-1530`, 0.19.2 `:2182-2198`), else the whole
  [2F, H] / [H, F]: the shapes of SequentialMLP's `ColumnParallelLinear` / `RowParallelLinear`
  over the expert-TP group at the same ETP.
- GLU layout: both split a rank's fc1 output with `torch.chunk(x, 2, dim=-1)` into [gate | up]
  (0.16.1 `transformer/moe/experts.py:722` TEGroupedMLP, `transformer/mlp.py:220` MLP; 0.19.2
  experts.py:866) and shard fc1 with `apply_swiglu_sharded_factory` (0.16.1 experts.py:797), so
  rank r holds [gate_r; up_r], as in SequentialMLP (stride-2 GLU column split). 0.19.2 adds
  `moe_mlp_glu_interleave_size` (block-interleaved gate/up, experts.py:720-726); megarl leaves it
  None, the contiguous layout.
- checkpoints: `TEGroupedMLP.sharded_state_dict` writes the keys SequentialMLP writes
  (`decoder.layers.mlp.experts.linear_fc1.weight` with an expert axis; 0.16.1 experts.py:768-806,
  0.19.2 :917, "The sharded state dict is interchangable with SequentialMLP's"), so `torch_dist`
  checkpoints need no translation.
- local index: `weight<k>` is local expert k, global expert `ep_rank * num_experts / EP + k`
  (`_sharded_state_dict_grouped`, 0.16.1 `extensions/transformer_engine.py:1748-1752`), the
  numbering of `local_experts.<k>`.

Not translated, refused by name: megatron-core 0.19's `moe_single_grouped_weight` (one
`mlp.experts.linear_fc1.weight` for all experts, TE >= 2.14) and the legacy `GroupedMLP`
(`mlp.experts.weight1` / `weight2`: [H, E*F] transposed, 0.16.1 experts.py:65-200), which megarl
never builds.
"""
from __future__ import annotations

import re

from megarl.bridge.errors import ConversionError

_GROUPED = re.compile(r"((?:^|\.)mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_SEQUENTIAL = re.compile(r"((?:^|\.)mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_UNSUPPORTED = re.compile(r"(?:^|\.)mlp\.experts\.(?:linear_fc[12]\.(?:weight|bias)|weight[12])$")


def is_grouped_expert(name: str) -> bool:
    """True for a grouped-GEMM expert parameter name (`...mlp.experts.linear_fc1.weight3`)."""
    return _GROUPED.search(name) is not None


def sequential_expert_name(name: str) -> str:
    """`...mlp.experts.linear_fc<n>.<weight|bias><k>` -> `...mlp.experts.local_experts.<k>.linear_fc<n>.<weight|bias>`
    (same local expert index k); any other name is returned unchanged. Raises `ConversionError` for
    the expert layouts megarl does not map (one parameter for all experts; legacy GroupedMLP)."""
    m = _GROUPED.search(name)
    if m:
        head, linear, kind, k = m.groups()
        return name[: m.start()] + f"{head}local_experts.{int(k)}.{linear}.{kind}"
    if _UNSUPPORTED.search(name):
        raise ConversionError(
            f"megatron parameter {name!r} holds every expert of a layer in one tensor (megatron-core's "
            "moe_single_grouped_weight, or the legacy GroupedMLP), which the bridge does not map; build the "
            "experts as TEGroupedMLP with one weight per expert (the default) or as SequentialMLP"
        )
    return name


def grouped_expert_name(name: str) -> str:
    """The inverse of `sequential_expert_name`: `...mlp.experts.local_experts.<k>.linear_fc<n>.weight`
    -> `...mlp.experts.linear_fc<n>.weight<k>`; any other name is returned unchanged."""
    m = _SEQUENTIAL.search(name)
    if not m:
        return name
    head, k, linear, kind = m.groups()
    return name[: m.start()] + f"{head}{linear}.{kind}{int(k)}"
