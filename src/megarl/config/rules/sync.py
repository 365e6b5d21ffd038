"""Rules on the weight sync's equality check."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig


def weight_check_needs_cpu_engine(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The per-tensor equality check after a push compares HF-named tensors: megarl's CPU engine
    holds them under those names, one rank per server; SGLang hashes its own fused, TP-sharded
    parameters (qkv_proj, gate_up_proj) with a GPU hash, which the actor's HF tensors do not match.

    Reads: actor_rollout_ref.rollout.check_weight_update, actor_rollout_ref.rollout.name
    """
    rollout = config.actor_rollout_ref.rollout
    if rollout.check_weight_update and rollout.name != "cpu":
        yield (f"actor_rollout_ref.rollout.check_weight_update=true needs actor_rollout_ref.rollout.name=cpu "
               f"(got {rollout.name!r}): SGLang's /weights_checker hashes its fused, TP-sharded parameters, "
               "not the HF tensors the actor sends")
