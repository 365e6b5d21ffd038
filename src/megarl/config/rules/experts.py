"""Rules for mixture-of-experts roles: parallel sizes (expert parallel EP, expert tensor parallel
ETP) of the training roles and of the rollout servers, and the expert module (`moe_grouped_gemm`)."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.errors import ConfigError
from megarl.config.expert_mlp import expert_mlp
from megarl.config.rules.common import DerivedSizes, largest_divisor_at_most, positive
from megarl.config.schema import ExperimentConfig, MegatronConfig


def _expert_problems(prefix: str, m: MegatronConfig, train_gpus: int) -> Iterator[str]:
    ep, etp, tp, pp = (m.expert_model_parallel_size, m.expert_tensor_parallel_size,
                       m.tensor_model_parallel_size, m.pipeline_model_parallel_size)
    yield from positive(f"{prefix}.expert_model_parallel_size", ep)
    yield from positive(f"{prefix}.expert_tensor_parallel_size", etp)
    if ep <= 0 or (etp is not None and etp <= 0) or tp <= 0 or pp <= 0:
        return
    etp = tp if etp is None else etp
    if etp not in (1, tp):
        yield (f"{prefix}.expert_tensor_parallel_size={etp}: must be 1 or "
               f"{prefix}.tensor_model_parallel_size={tp} (null means the latter)")
    elif etp != tp and ep == 1:
        # megatron-core 0.16.1 marks expert weights as expert parameters only when EP > 1
        # (tensor_parallel/layers.py:829/886): DP ranks would average different expert shards.
        yield (f"{prefix}.expert_tensor_parallel_size={etp} differs from {prefix}.tensor_model_parallel_size={tp} "
               f"with {prefix}.expert_model_parallel_size=1, which megatron-core trains wrongly; set "
               "expert_tensor_parallel_size to null or expert_model_parallel_size > 1")
    # with EP 1 and ETP = TP the experts lie as the dense layers do, and parallel_sizes_fit_training_gpus
    # already names a layout that does not divide the GPUs (a dense model's case): no second message
    if train_gpus and (ep, etp) != (1, tp) and train_gpus % (etp * ep * pp):
        yield (f"{prefix}: ETP x EP x PP = {etp} x {ep} x {pp} does not divide the {train_gpus} training GPUs "
               f"(megatron places the experts of each pipeline stage over ETP x EP ranks)")


def training_roles(config: ExperimentConfig) -> list[tuple[str, MegatronConfig]]:
    """(section, its megatron group) of every training role the config builds."""
    arr = config.actor_rollout_ref
    roles = [("actor_rollout_ref.actor", arr.actor.megatron), ("actor_rollout_ref.ref", arr.ref.megatron)]
    if config.critic.enable:
        roles.append(("critic", config.critic.megatron))
    if config.reward_model.enable:
        roles.append(("reward_model", config.reward_model.megatron))
    return roles


def _lora_key(config: ExperimentConfig, section: str) -> tuple[str, int]:
    """(key, rank) of a role's LoRA adapters; rank 0 for the roles never adapted (reference, reward model)."""
    if section == "actor_rollout_ref.actor":
        return "actor_rollout_ref.model.lora.rank", config.actor_rollout_ref.model.lora.rank
    if section == "critic":
        return "critic.model.lora.rank", config.critic.model.lora.rank
    return "", 0


def expert_parallel_fits_role(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Each training role's EP and ETP are positive, ETP is 1 or TP (TP when EP = 1), and
    ETP x EP x PP divides the training GPUs.

    Reads: actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron, critic.enable, critic.megatron,
    reward_model.enable, reward_model.megatron, trainer.nnodes, trainer.n_gpus_per_node, placement.mode,
    placement.rollout_gpus
    """
    for section, megatron in training_roles(config):
        yield from _expert_problems(f"{section}.megatron", megatron, sizes.train_gpus)


def rollout_expert_parallel_fits_server(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A rollout server's expert parallel size (SGLang's `--ep-size`) splits the experts over the
    server's own GPUs: SGLang lays its EP ranks over its TP ranks, so EP divides the server's TP
    size; megarl's CPU engine serves a whole model in one process and takes EP 1 only.

    Reads: actor_rollout_ref.rollout.name, actor_rollout_ref.rollout.expert_parallel_size,
    actor_rollout_ref.rollout.tensor_model_parallel_size
    """
    r = config.actor_rollout_ref.rollout
    ep, tp = r.expert_parallel_size, r.tensor_model_parallel_size
    if ep <= 0 or tp <= 0 or ep == 1:
        return  # positive_counts names a size <= 0
    key = f"actor_rollout_ref.rollout.expert_parallel_size={ep}"
    if r.name == "cpu":
        yield (f"{key}: megarl's CPU engine (actor_rollout_ref.rollout.name=cpu) serves a whole model in one process "
               "and splits no experts, so it takes 1 only; SGLang (rollout.name=sglang) splits them")
    elif tp % ep:
        # SGLang 0.5.23 runtime_context.py: derive_parallel_widths sets moe_tp_size = tp_size // ep_size //
        # moe_dp_size and _validate_parallel refuses tp_size != moe_ep_size x moe_dp_size x moe_tp_size
        # (megarl leaves moe_dp_size at 1): EP ranks are TP ranks, so ep_size must divide tp_size
        yield (f"{key} must divide actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: SGLang splits a server's "
               f"experts over its own {tp} GPU(s), its TP ranks (tp_size = ep_size x MoE TP size), so try "
               f"expert_parallel_size={largest_divisor_at_most(tp, ep)}" + (
                   f" or tensor_model_parallel_size={ep}" if ep > tp else ""))


def grouped_gemm_can_run(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """`megatron.moe_grouped_gemm=true` of a training role can run somewhere: by the engine's own
    decision (`megarl.config.expert_mlp`) on each device `trainer.device` allows (auto: CUDA or
    CPU), taking transformer-engine as installed on CUDA (the engine checks that when it starts);
    a role with LoRA adapters builds local layers. Refused only when it fails on every such device.

    Reads: actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron, critic.enable, critic.megatron,
    reward_model.enable, reward_model.megatron, trainer.device, actor_rollout_ref.model.lora.rank,
    critic.model.lora.rank
    """
    devices = {"cuda": ["cuda"], "cpu": ["cpu"]}.get(config.trainer.device, ["cuda", "cpu"])
    for section, megatron in training_roles(config):
        if not megatron.moe_grouped_gemm:
            continue
        lora_key, lora_rank = _lora_key(config, section)
        problems = []
        for device in devices:
            try:
                expert_mlp(True, device, te_layers=device == "cuda" and lora_rank == 0, te_grouped_linear=True,
                           section=section)
            except ConfigError as problem:
                problems.append(str(problem))
        if len(problems) == len(devices):
            keys = [f"trainer.device={config.trainer.device}"] + ([f"{lora_key}={lora_rank}"] if lora_rank else [])
            yield f"{problems[0]} ({', '.join(keys)})"
