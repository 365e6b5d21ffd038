"""Turn a validated experiment config into the planner's inputs, and plan."""
from __future__ import annotations

from megarl.config import ExperimentConfig
from megarl.config.schema import MegatronConfig
from megarl.placement.planner import ClusterSpec, Plan, RoleSpec, plan_placement

TRAIN_POOL, ROLLOUT_POOL, SHARED_POOL, TEACHER_POOL = "train", "rollout", "shared", "teacher"


def _train_role(name: str, pool: str, m: MegatronConfig, prefix: str) -> RoleSpec:
    return RoleSpec(name, pool, "train", tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                    cp=m.context_parallel_size, ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size,
                    tp_key=f"{prefix}.megatron.tensor_model_parallel_size",
                    pp_key=f"{prefix}.megatron.pipeline_model_parallel_size",
                    ep_key=f"{prefix}.megatron.expert_model_parallel_size")


def actor_role_spec(config: ExperimentConfig, pool: str) -> RoleSpec:
    return _train_role("actor", pool, config.actor_rollout_ref.actor.megatron, "actor_rollout_ref.actor")


def ref_role_spec(config: ExperimentConfig, pool: str) -> RoleSpec:
    return _train_role("ref", pool, config.actor_rollout_ref.ref.megatron, "actor_rollout_ref.ref")


def roles_from_config(config: ExperimentConfig) -> tuple[dict[str, int], list[RoleSpec]]:
    """(pool sizes in GPUs, role specs) for the experiment. The reference model exists when a KL
    term needs it; the critic when enabled (GAE); the reward model when enabled; the teacher with
    a Megatron on-policy-distillation teacher (`distillation`): on the training pool, beside the
    reference, or on a pool of its own (`distillation.teacher.gpus`, the last GPUs)."""
    t, p, arr, d = config.trainer, config.placement, config.actor_rollout_ref, config.distillation
    total = t.nnodes * t.n_gpus_per_node
    megatron_teacher = d.enabled and d.type == "megatron"
    teacher_gpus = d.teacher.gpus if megatron_teacher else 0
    if p.mode == "split":
        pools = {TRAIN_POOL: total - teacher_gpus - p.rollout_gpus, ROLLOUT_POOL: p.rollout_gpus}
        train_pool, rollout_pool = TRAIN_POOL, ROLLOUT_POOL
    else:
        pools = {SHARED_POOL: total - teacher_gpus}
        train_pool = rollout_pool = SHARED_POOL
    if teacher_gpus:
        pools[TEACHER_POOL] = teacher_gpus
    roles = [actor_role_spec(config, train_pool)]
    if arr.actor.use_kl_loss or config.algorithm.use_kl_in_reward:
        roles.append(ref_role_spec(config, train_pool))
    if config.critic.enable:
        roles.append(_train_role("critic", train_pool, config.critic.megatron, "critic"))
    if config.reward_model.enable:
        roles.append(_train_role("reward_model", train_pool, config.reward_model.megatron, "reward_model"))
    if megatron_teacher:
        roles.append(_train_role("teacher", TEACHER_POOL if teacher_gpus else train_pool, d.teacher.megatron,
                                 "distillation.teacher"))
    roles.append(RoleSpec("rollout", rollout_pool, "rollout", tp=arr.rollout.tensor_model_parallel_size,
                          ep=arr.rollout.expert_parallel_size, attn_dp=arr.rollout.attention_data_parallel_size,
                          tp_key="actor_rollout_ref.rollout.tensor_model_parallel_size",
                          ep_key="actor_rollout_ref.rollout.expert_parallel_size"))
    return pools, roles


def plan_from_config(config: ExperimentConfig, node_names: tuple[str, ...] = ()) -> Plan:
    pools, roles = roles_from_config(config)
    cluster = ClusterSpec(config.trainer.nnodes, config.trainer.n_gpus_per_node, tuple(node_names))
    return plan_placement(cluster, pools, roles)


def offline_plan(config: ExperimentConfig, with_ref: bool) -> Plan:
    """The plan of an offline trainer: the actor (and, for DPO, the frozen reference) on every GPU
    of the allocation, no rollout servers."""
    t = config.trainer
    roles = [actor_role_spec(config, TRAIN_POOL)] + ([ref_role_spec(config, TRAIN_POOL)] if with_ref else [])
    return plan_placement(ClusterSpec(t.nnodes, t.n_gpus_per_node), {TRAIN_POOL: t.nnodes * t.n_gpus_per_node}, roles)
