"""Rules on the LoRA adapters of the actor (`actor_rollout_ref.model.lora`) and the critic (`critic.model.lora`)."""
from __future__ import annotations

import logging
from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import LORA_TARGETS, ExperimentConfig

log = logging.getLogger("megarl.config")
ALL_LINEAR = "all-linear"


def lora_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """For the actor's and the critic's adapters each: a LoRA rank >= 0; with LoRA on (rank > 0):
    a positive alpha, PEFT target names megarl maps onto megatron's layers, a dropout
    probability in [0, 1). The actor with adapter-only sync: no weight-equality
    check (it checksums base tensors, which that sync never sends); with `sync_via=disk` on more
    than one node a warning (no error): the servers read the adapters from
    trainer.default_local_dir, which must then be on a filesystem every node mounts at the same
    path, and no config key says whether it is (a server that cannot read it fails the first push,
    naming the directory). The critic pushes nothing: its `sync` stays merged. The reference model
    is never adapted (it is the frozen base). An adapted role takes no sequence parallelism: the
    adapters see a column-parallel layer's whole input, which sequence parallelism splits along the sequence.

    Reads: actor_rollout_ref.model.lora, critic.model.lora, actor_rollout_ref.rollout.check_weight_update,
    trainer.nnodes, trainer.default_local_dir, actor_rollout_ref.actor.megatron, critic.megatron
    """
    actor = config.actor_rollout_ref.model.lora
    yield from _adapter_settings(actor, "actor_rollout_ref.model.lora")
    yield from _no_sequence_parallel(actor, "actor_rollout_ref.model.lora", config.actor_rollout_ref.actor.megatron,
                                     "actor_rollout_ref.actor.megatron")
    if actor.rank > 0 and actor.sync == "adapter" and config.actor_rollout_ref.rollout.check_weight_update:
        yield ("actor_rollout_ref.model.lora.sync=adapter with actor_rollout_ref.rollout.check_weight_update=true: "
               "the check compares the base weights a push sends, and adapter-only sync sends none; turn the check "
               "off or use sync=merged")
    if actor.rank > 0 and actor.sync == "adapter" and actor.sync_via == "disk" and config.trainer.nnodes > 1:
        log.warning(
            "actor_rollout_ref.model.lora.sync_via=disk with trainer.nnodes=%d: every rollout server loads the "
            "adapters the trainer writes under trainer.default_local_dir=%s (lora_sync/), so that directory must be "
            "on a filesystem every node mounts at the same path (megarl cannot tell from the config); "
            "sync_via=tensors (the default) sends them in the request and needs no shared filesystem",
            config.trainer.nnodes, config.trainer.default_local_dir,
        )
    critic = config.critic.model.lora
    yield from _adapter_settings(critic, "critic.model.lora")
    yield from _no_sequence_parallel(critic, "critic.model.lora", config.critic.megatron, "critic.megatron")
    if critic.rank > 0 and critic.sync != "merged":
        yield f"critic.model.lora.sync={critic.sync}: the critic pushes no weights; leave it merged"


def _no_sequence_parallel(lora, key: str, megatron, section: str) -> Iterator[str]:
    """LoRA's column-parallel adapters take the base layer's input whole (megarl.engines.megatron.lora);
    with sequence parallelism (at TP > 1) megatron's column-parallel layer all-gathers that input itself."""
    if lora.rank > 0 and megatron.sequence_parallel and megatron.tensor_model_parallel_size > 1:
        yield (f"{key}.rank={lora.rank} with {section}.sequence_parallel=true: megarl's LoRA adapters take a layer's "
               f"whole input, which sequence parallelism splits over the {megatron.tensor_model_parallel_size} "
               f"tensor-parallel ranks; set {section}.sequence_parallel=false")


def _adapter_settings(lora, key: str) -> Iterator[str]:
    if lora.rank < 0:
        yield f"{key}.rank={lora.rank}: must be >= 0 (0 turns LoRA off)"
    if lora.rank <= 0:
        return
    if lora.alpha <= 0:
        yield f"{key}.alpha={lora.alpha}: must be positive (the adapter output is scaled by alpha / rank)"
    if not 0 <= lora.dropout < 1:
        yield f"{key}.dropout={lora.dropout}: must be in [0, 1) (the probability of zeroing an adapter input)"
    targets = list(lora.target_modules)
    unknown = [t for t in targets if t not in LORA_TARGETS and t != ALL_LINEAR]
    if not targets:
        yield f"{key}.target_modules is empty: name PEFT modules ({', '.join(LORA_TARGETS)}) or {ALL_LINEAR}"
    elif unknown:
        yield (f"{key}.target_modules: unknown {unknown}; choose from {list(LORA_TARGETS)} or "
               f"[{ALL_LINEAR}] (PEFT names; megarl maps them onto megatron's fused layers)")


def lora_targets(target_modules) -> tuple[str, ...]:
    """The PEFT target names of `target_modules`, in LORA_TARGETS order ("all-linear": all of them)."""
    wanted = set(target_modules)
    return tuple(t for t in LORA_TARGETS if ALL_LINEAR in wanted or t in wanted)
