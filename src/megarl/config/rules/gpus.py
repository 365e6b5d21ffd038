"""Rules on GPUs: the placement's pools, rollout servers and training parallel sizes against the
nodes, and the batch arithmetic from prompts down to micro-batches on each data-parallel rank."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes, largest_divisor_at_most, model_parallel_size, positive
from megarl.config.schema import ExperimentConfig, MegatronConfig


def layout_problems(prefix: str, m: MegatronConfig, train_gpus: int, gpus_per_node: int) -> Iterator[str]:
    """One role's parallel sizes against the training GPUs."""
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        yield from positive(f"{prefix}.{key}", getattr(m, key))
    if min(tp, pp, m.context_parallel_size) <= 0:
        return
    if m.virtual_pipeline_model_parallel_size is not None:
        if pp == 1:
            yield (
                f"{prefix}.virtual_pipeline_model_parallel_size={m.virtual_pipeline_model_parallel_size}: "
                f"needs {prefix}.pipeline_model_parallel_size > 1 (or set it to null)"
            )
        yield from positive(f"{prefix}.virtual_pipeline_model_parallel_size", m.virtual_pipeline_model_parallel_size)
    if gpus_per_node % tp:
        yield (
            f"{prefix}.tensor_model_parallel_size={tp}: a TP group must stay inside one node, so it must divide "
            f"trainer.n_gpus_per_node={gpus_per_node} (try {largest_divisor_at_most(gpus_per_node, tp)})"
        )
        return
    mp = model_parallel_size(m)
    if train_gpus % mp:
        yield (
            f"{prefix}: TP x PP x CP = {tp} x {pp} x {m.context_parallel_size} = {mp} GPUs per model replica "
            f"does not divide the {train_gpus} training GPUs; change the parallel sizes or the GPU count"
        )


def _batch_problems(role: str, mini_key: str, mini: int, micro_key: str, micro, dynamic: bool,
                    train_batch: int, n: int, dp: int) -> Iterator[str]:
    """Prompts -> responses -> mini-batches -> DP ranks -> micro-batches must all divide."""
    responses = train_batch * n
    if mini > train_batch:
        yield f"{mini_key}={mini} prompts is larger than data.train_batch_size={train_batch} prompts per step"
        return
    if train_batch % mini:
        yield (
            f"{mini_key}={mini} prompts must divide data.train_batch_size={train_batch} prompts "
            f"(each step is cut into whole mini-batches)"
        )
        return
    mini_responses = mini * n
    if responses % dp:
        yield (
            f"data.train_batch_size={train_batch} prompts x actor_rollout_ref.rollout.n={n} = {responses} responses "
            f"cannot be split evenly over the {role} data-parallel size {dp}"
        )
        return
    if mini_responses % dp:
        yield (
            f"{mini_key}={mini} prompts x actor_rollout_ref.rollout.n={n} = {mini_responses} responses per mini-batch "
            f"cannot be split evenly over the {role} data-parallel size {dp}"
        )
        return
    per_rank = mini_responses // dp
    if micro is not None and not dynamic and micro > 0 and per_rank % micro:
        yield (
            f"{micro_key}={micro} responses must divide the {per_rank} responses each {role} data-parallel rank "
            f"gets per mini-batch ({mini} prompts x {n} / DP {dp})"
        )


def placement_pools(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A split leaves GPUs for both pools; colocate takes no rollout GPU count.

    Reads: placement.mode, placement.rollout_gpus, trainer.nnodes, trainer.n_gpus_per_node
    """
    p, total = config.placement, sizes.total_gpus
    if not total:
        return
    if p.mode == "split":
        if not 0 < p.rollout_gpus < total:
            yield (
                f"placement.rollout_gpus={p.rollout_gpus}: with placement.mode=split it must leave GPUs for both "
                f"pools (1 .. {total - 1} of the {total} GPUs)"
            )
    elif p.rollout_gpus:
        yield (
            f"placement.rollout_gpus={p.rollout_gpus} is used only with placement.mode=split "
            f"(colocate shares all GPUs)"
        )


def rollout_servers_fit_nodes(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A rollout server's TP group stays inside one node (dividing its GPUs) or, for SGLang only,
    spans whole nodes (a multiple of them: one server process per node, SGLang's `--nnodes`);
    either way it divides the rollout pool. megarl's CPU engine servers run on one node.

    Reads: actor_rollout_ref.rollout.name, actor_rollout_ref.rollout.tensor_model_parallel_size,
    trainer.nnodes, trainer.n_gpus_per_node, placement.mode, placement.rollout_gpus
    """
    gpus_per_node, pool = config.trainer.n_gpus_per_node, sizes.rollout_gpus
    r = config.actor_rollout_ref.rollout
    rtp = r.tensor_model_parallel_size
    if not sizes.total_gpus or rtp <= 0 or gpus_per_node <= 0:
        return
    key = f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp}"
    if rtp > gpus_per_node and r.name == "cpu":
        yield (
            f"{key} is more than trainer.n_gpus_per_node={gpus_per_node}: a server spanning nodes needs "
            f"actor_rollout_ref.rollout.name=sglang; megarl's CPU engine (actor_rollout_ref.rollout.name=cpu) "
            f"runs each server on one node, so the size must divide trainer.n_gpus_per_node"
        )
    elif rtp > gpus_per_node and rtp % gpus_per_node:
        yield (
            f"{key}: a rollout server larger than a node spans whole nodes, so it must be a multiple of "
            f"trainer.n_gpus_per_node={gpus_per_node} (try {rtp - rtp % gpus_per_node})"
        )
    elif rtp <= gpus_per_node and gpus_per_node % rtp:
        yield (
            f"{key}: a rollout server within a node must divide trainer.n_gpus_per_node={gpus_per_node} "
            f"(try {largest_divisor_at_most(gpus_per_node, rtp)}), or span whole nodes as a multiple of it"
        )
    elif pool and pool % rtp:
        yield f"{key} GPUs per server must divide the {pool} rollout GPUs"


def rollout_attention_data_parallel_fits_server(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A rollout server's attention data parallel size (SGLang's `--attn-dp-size`) splits its
    tensor_model_parallel_size GPUs into groups of equal size, so it divides them (SGLang 0.5.23
    `arg_groups/parallel_hook.py::handle_data_parallelism` asserts `tp_size % attn_dp_size == 0` as the
    server resolves its arguments). Only SGLang on GPUs runs it: megarl's CPU engine serves a model in
    one process; SGLang 0.5.23 on a CPU starts with it, but its scheduler dies at the first batch:
    attention DP pads each group's batch (`model_executor/forward_batch_info.py::_pad_inputs_to_size`)
    with `attn_backend.get_cpu_graph_seq_len_fill_value()`, which the CPU's torch_native backend lacks
    ("AttributeError: 'TorchNativeAttnBackend' object has no attribute
    'get_cpu_graph_seq_len_fill_value'"; only intel_amx has it, and it needs sgl_kernel's compiled CPU kernels).

    Reads: actor_rollout_ref.rollout.name, actor_rollout_ref.rollout.attention_data_parallel_size,
    actor_rollout_ref.rollout.tensor_model_parallel_size, trainer.device
    """
    r = config.actor_rollout_ref.rollout
    attn_dp, tp = r.attention_data_parallel_size, r.tensor_model_parallel_size
    if attn_dp <= 1 or tp <= 0:
        return  # positive_counts names a size <= 0
    key = f"actor_rollout_ref.rollout.attention_data_parallel_size={attn_dp}"
    if r.name == "cpu":
        yield (f"{key}: megarl's CPU engine (actor_rollout_ref.rollout.name=cpu) serves a whole model in one process "
               "and has no attention data parallelism; SGLang (rollout.name=sglang) on GPUs has")
    elif config.trainer.device == "cpu":
        yield (f"{key} with rollout.name=sglang and trainer.device=cpu: SGLang 0.5.23 on a CPU starts with "
               "--attn-dp-size but its scheduler dies at the first batch (forward_batch_info.py _pad_inputs_to_size: "
               "'TorchNativeAttnBackend' object has no attribute 'get_cpu_graph_seq_len_fill_value'); set 1")
    if tp % attn_dp:
        yield (f"{key} must divide actor_rollout_ref.rollout.tensor_model_parallel_size={tp}, the server's GPUs, "
               f"into attention groups of equal size (SGLang asserts tp_size % attn_dp_size == 0: "
               f"arg_groups/parallel_hook.py handle_data_parallelism); try "
               f"attention_data_parallel_size={largest_divisor_at_most(tp, attn_dp)}")


def parallel_sizes_fit_training_gpus(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Each training role's TP x PP x CP fits the nodes and divides the training GPUs.

    Reads: actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron, critic.enable, critic.megatron,
    reward_model.enable, reward_model.megatron, trainer.nnodes, trainer.n_gpus_per_node, placement.mode,
    placement.rollout_gpus
    """
    train_gpus, gpus_per_node = sizes.train_gpus, config.trainer.n_gpus_per_node
    if not train_gpus:
        return
    arr = config.actor_rollout_ref
    roles = [("actor_rollout_ref.actor.megatron", arr.actor.megatron),
             ("actor_rollout_ref.ref.megatron", arr.ref.megatron)]
    if config.critic.enable:
        roles.append(("critic.megatron", config.critic.megatron))
    if config.reward_model.enable:
        roles.append(("reward_model.megatron", config.reward_model.megatron))
    for prefix, megatron in roles:
        yield from layout_problems(prefix, megatron, train_gpus, gpus_per_node)


def batch_arithmetic(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The actor's (and critic's) prompts -> mini-batches -> DP ranks -> micro-batches all divide.

    Reads: data.train_batch_size, actor_rollout_ref.rollout.n, actor_rollout_ref.actor.ppo_mini_batch_size,
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, actor_rollout_ref.actor.use_dynamic_bsz,
    actor_rollout_ref.actor.megatron, critic.enable, critic.ppo_mini_batch_size,
    critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz, critic.megatron, trainer.nnodes,
    trainer.n_gpus_per_node, placement.mode, placement.rollout_gpus
    """
    if not sizes.train_gpus:
        return
    train_batch, n = config.data.train_batch_size, config.actor_rollout_ref.rollout.n
    actor, critic = config.actor_rollout_ref.actor, config.critic
    if sizes.actor_dp and train_batch > 0 and actor.ppo_mini_batch_size > 0 and n > 0:
        yield from _batch_problems(
            "actor", "actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu,
            actor.use_dynamic_bsz, train_batch, n, sizes.actor_dp,
        )
    if not critic.enable:
        return
    yield from positive("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size)
    if sizes.critic_dp and train_batch > 0 and critic.ppo_mini_batch_size > 0 and n > 0:
        yield from _batch_problems(
            "critic", "critic.ppo_mini_batch_size", critic.ppo_mini_batch_size,
            "critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu,
            critic.use_dynamic_bsz, train_batch, n, sizes.critic_dp,
        )
