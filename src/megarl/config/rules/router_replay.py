"""Rules on MoE routing replay (`actor_rollout_ref.actor.router_replay`) and the router losses."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig


def router_replay_fits(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Routing replay (mode R3) needs routes for every trained token: single-turn generation by
    the CPU engine or SGLang (the server flag `--enable-return-routed-experts` is added by megarl;
    agent episodes carry no routes yet). Activation recomputation, at any pipeline size, replays each
    micro-batch's own routes (megarl.engines.megatron.replay.RouteReplay). The router loss
    coefficients are >= 0. Whether the model is MoE is checked where it is read (preflight and the
    actor engine).

    Reads: actor_rollout_ref.actor.router_replay.mode, actor_rollout_ref.rollout.name,
    actor_rollout_ref.rollout.agent.path, actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron,
    critic.megatron
    """
    arr = config.actor_rollout_ref
    key = "actor_rollout_ref.actor.router_replay.mode"
    for prefix, m in (("actor_rollout_ref.actor.megatron", arr.actor.megatron),
                      ("actor_rollout_ref.ref.megatron", arr.ref.megatron), ("critic.megatron", config.critic.megatron)):
        if m.moe_aux_loss_coeff < 0:
            yield f"{prefix}.moe_aux_loss_coeff={m.moe_aux_loss_coeff}: must be >= 0 (0: no load-balancing loss)"
        if m.moe_z_loss_coeff is not None and m.moe_z_loss_coeff < 0:
            yield f"{prefix}.moe_z_loss_coeff={m.moe_z_loss_coeff}: must be >= 0 or null (no z-loss)"
    if arr.actor.router_replay.mode != "R3":
        return
    if arr.rollout.name not in ("cpu", "sglang"):
        yield f"{key}=R3 needs actor_rollout_ref.rollout.name cpu or sglang (they return routed experts)"
    if arr.rollout.agent.path:
        yield (f"{key}=R3 with actor_rollout_ref.rollout.agent.path: agent episodes do not carry routed experts "
               "yet; set mode=disabled")


def replays_routes(config: ExperimentConfig) -> bool:
    """True when the rollout servers must return routed experts and the actor replays them."""
    return config.actor_rollout_ref.actor.router_replay.mode == "R3"
