"""Rules on the actor's LoRA adapters (`actor_rollout_ref.model.lora`)."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import LORA_TARGETS, ExperimentConfig

ALL_LINEAR = "all-linear"


def lora_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A LoRA rank >= 0; with LoRA on (rank > 0): a positive alpha, PEFT target names megarl
    maps onto megatron's layers, no dropout (the engine's exactness checks assume none), and
    with adapter-only sync no weight-equality check (it checksums base tensors, which that sync
    never sends). The reference model and the critic are never adapted: the reference is the
    frozen base, the critic trains all weights.

    Reads: actor_rollout_ref.model.lora, actor_rollout_ref.rollout.check_weight_update
    """
    lora = config.actor_rollout_ref.model.lora
    key = "actor_rollout_ref.model.lora"
    if lora.rank < 0:
        yield f"{key}.rank={lora.rank}: must be >= 0 (0 turns LoRA off)"
    if lora.rank <= 0:
        return
    if lora.alpha <= 0:
        yield f"{key}.alpha={lora.alpha}: must be positive (the adapter output is scaled by alpha / rank)"
    if lora.dropout != 0:
        yield f"{key}.dropout={lora.dropout}: LoRA dropout is not supported yet; set it to 0"
    targets = list(lora.target_modules)
    unknown = [t for t in targets if t not in LORA_TARGETS and t != ALL_LINEAR]
    if not targets:
        yield f"{key}.target_modules is empty: name PEFT modules ({', '.join(LORA_TARGETS)}) or {ALL_LINEAR}"
    elif unknown:
        yield (f"{key}.target_modules: unknown {unknown}; choose from {list(LORA_TARGETS)} or "
               f"[{ALL_LINEAR}] (PEFT names; megarl maps them onto megatron's fused layers)")
    if lora.sync == "adapter" and config.actor_rollout_ref.rollout.check_weight_update:
        yield (f"{key}.sync=adapter with actor_rollout_ref.rollout.check_weight_update=true: the check compares the "
               "base weights a push sends, and adapter-only sync sends none; turn the check off or use sync=merged")


def lora_targets(target_modules) -> tuple[str, ...]:
    """The PEFT target names of `target_modules`, in LORA_TARGETS order ("all-linear": all of them)."""
    wanted = set(target_modules)
    return tuple(t for t in LORA_TARGETS if ALL_LINEAR in wanted or t in wanted)
