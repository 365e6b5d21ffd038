"""What each training role moves off the GPUs while the rollout servers generate: the offload
plan, a pure function of the config. The runtime (`runtime/cluster.py`) executes it and the memory
estimate (`memory.py`) subtracts it, so `megarl plan` and a run agree by construction.

Only colocated placement offloads: split pools give the servers their own GPUs, so moving a
training role's states to host memory frees nothing generation could use (a config rule rejects
the keys there). Per role, its `megatron.{param,grad,optimizer}_offload` keys choose the parts:

  actor, critic   parameters, gradient buffers, optimizer state: as their keys say
  ref             parameters only (it has no gradients or optimizer)
  teacher         parameters only, as the reference (on-policy distillation's Megatron teacher on
                  the training pool; on a pool of its own it shares no GPU with the servers and a
                  config rule rejects the key)
  reward_model    nothing: it scores between generation rounds, while the servers hold their
                  memory, so offloading it would not lower the peak (a config rule rejects the keys)

The order of one colocated step (`trainer/rl.py`, `runtime/cluster.py`):

  generate (every role offloaded as planned; servers hold weights and KV cache)
  -> release the servers' memory -> onload every planned role
  -> old/ref log-probs, values, updates
  -> push the actor's weights (servers resume weights first)
  -> offload every planned role -> servers resume their KV cache -> next generation

(With `rollout.free_cache_engine: false` the servers' release and resumes are left out:
`releases_server_memory`.)
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.config.schema import ExperimentConfig, MegatronConfig


@dataclass(frozen=True)
class OffloadParts:
    """Which parts of one role's states leave the device while generating."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False

    def any(self) -> bool:
        return self.params or self.grads or self.optimizer


def releases_server_memory(config: ExperimentConfig) -> bool:
    """Whether the rollout servers release their memory (weights, KV cache, CUDA graphs) while the
    training roles run: colocated placement with `actor_rollout_ref.rollout.free_cache_engine`
    (verl's key, default true). Otherwise the servers keep it through training (colocated, the
    memory estimate counts it in the training phase: `memory.py`), no release or resume call is
    made, and the weight push drains them with `/flush_cache` as for split pools. (SGLang 0.5.23's
    `/release_memory_occupation` and `/resume_memory_occupation` come in pairs: nothing is resumed
    that was not released.)"""
    return config.placement.mode == "colocate" and config.actor_rollout_ref.rollout.free_cache_engine


def role_megatron(config: ExperimentConfig, role: str) -> MegatronConfig:
    """The `megatron` section of a training role."""
    arr = config.actor_rollout_ref
    return {"actor": arr.actor.megatron, "ref": arr.ref.megatron, "critic": config.critic.megatron,
            "reward_model": config.reward_model.megatron, "teacher": config.distillation.teacher.megatron}[role]


def offload_plan(config: ExperimentConfig, roles) -> dict[str, OffloadParts]:
    """{role: parts to offload while generating} for the training roles in `roles` (names, e.g.
    a `Plan`'s roles) that offload anything; {} unless `placement.mode` is colocate."""
    if config.placement.mode != "colocate":
        return {}
    plan = {}
    for role in ("actor", "ref", "critic", "teacher"):
        if role not in roles:
            continue
        m = role_megatron(config, role)
        trains = role not in ("ref", "teacher")
        parts = OffloadParts(params=m.param_offload, grads=trains and m.grad_offload,
                             optimizer=trains and m.optimizer_offload)
        if parts.any():
            plan[role] = parts
    return plan
