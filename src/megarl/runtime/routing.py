"""Routing replay in the controller: what the rollout client asks the servers for."""
from __future__ import annotations

from typing import Optional

from megarl.config import ConfigError, ExperimentConfig
from megarl.config.rules.router_replay import replays_routes


def routed_experts_layout(config: ExperimentConfig) -> Optional[tuple[int, int, int]]:
    """(layers, top_k, experts) of the actor's MoE model when routing replay is on, else None.
    Replay on a dense model is refused naming the key."""
    if not replays_routes(config):
        return None
    from megarl.bridge import arch_from_hf_config, load_hf_config

    path = config.actor_rollout_ref.model.path
    arch = arch_from_hf_config(load_hf_config(path), f"actor_rollout_ref.model.path={path!r}")
    if arch.moe is None:
        raise ConfigError(f"actor_rollout_ref.actor.router_replay.mode=R3 needs an MoE model; {path} has no experts "
                          "(set the mode to disabled)")
    return arch.num_layers, arch.moe.topk, arch.moe.num_experts
