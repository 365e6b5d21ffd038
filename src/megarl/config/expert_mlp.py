"""Which megatron-core module runs a role's MoE experts: grouped GEMM or one MLP per expert.

`expert_mlp` is the one decision, pure (the caller says what the machine has); the engine applies
it when it builds a role's model (`megarl.engines.megatron.model.moe_settings`) and the config rule
`megarl.config.rules.experts.grouped_gemm_can_run` refuses at config time what fails everywhere.

The rule it follows (megatron-core 0.16.1 and 0.19.2, read, not run here):
- "grouped" is `TEGroupedMLP`: megatron builds it only in the transformer-engine layer spec with
  `moe_grouped_gemm=True` and only when it defines `TEColumnParallelGroupedLinear`, i.e. when
  transformer-engine >= 1.9.0.dev0 is installed (0.16.1 `extensions/transformer_engine.py:1457`,
  `extensions/transformer_engine_spec_provider.py:61-79`; 0.19.2 `:2104`, `:75-85`). Otherwise
  the same request silently gives the legacy `GroupedMLP` (0.16.1; `weight1`/`weight2`, needs the
  `grouped_gemm` package) or `SequentialMLP` (0.19.2): megarl never asks there.
- The local layer spec (CPU, no transformer-engine, and every LoRA role: `builds_with_transformer_engine`)
  takes `moe_grouped_gemm=True` as the legacy `GroupedMLP` (0.16.1 `models/backends.py:117-126`) or
  ignores it (0.19.2 `models/backends.py:133`): there the experts are `SequentialMLP`.
- transformer-engine's GroupedLinear computes with its CUDA extension (`general_grouped_gemm`,
  `transformer_engine_torch`; TE 2.11 `pytorch/module/grouped_linear.py:13,197`): no CPU path.
"""
from __future__ import annotations

from typing import Literal, Optional

from megarl.config.errors import ConfigError

ExpertMLP = Literal["grouped", "sequential"]
KEY = "megatron.moe_grouped_gemm"


def expert_mlp(requested: Optional[bool], device: str, te_layers: bool, te_grouped_linear: bool,
               *, section: str) -> ExpertMLP:
    """`requested`: the role's `megatron.moe_grouped_gemm` (None: auto); `device`: the training
    device ("cuda" or "cpu"); `te_layers`: the role builds transformer-engine layers (CUDA,
    transformer-engine installed, no LoRA); `te_grouped_linear`: megatron-core defines
    `TEColumnParallelGroupedLinear` (transformer-engine >= 1.9). Auto picks grouped wherever it
    can run; `requested=True` where it cannot raises a ConfigError naming `<section>.megatron.moe_grouped_gemm`."""
    if requested is False:
        return "sequential"
    if device != "cuda":
        why = f"the role trains on {device}, and transformer-engine's grouped GEMM runs on CUDA only"
    elif not te_layers:
        why = ("the role builds megatron's local layer spec (transformer-engine is not installed, or the role "
               "has LoRA adapters, which need local layers), where the experts are SequentialMLP")
    elif not te_grouped_linear:
        why = ("the installed transformer-engine has no GroupedLinear for megatron-core (it needs "
               "transformer-engine >= 1.9), which would fall back to the legacy GroupedMLP")
    else:
        return "grouped"
    if requested:
        raise ConfigError(f"{section}.{KEY}=true cannot run: {why}; set it to null (auto) or false")
    return "sequential"
