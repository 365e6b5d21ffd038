"""Rules for mixture-of-experts parallel sizes (expert parallel EP, expert tensor parallel ETP)."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes, positive
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
    if train_gpus and train_gpus % (etp * ep * pp):
        yield (f"{prefix}: ETP x EP x PP = {etp} x {ep} x {pp} does not divide the {train_gpus} training GPUs "
               f"(megatron places the experts of each pipeline stage over ETP x EP ranks)")


def expert_parallel_fits_role(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Each training role's EP and ETP are positive, ETP is 1 or TP (TP when EP = 1), and
    ETP x EP x PP divides the training GPUs.

    Reads: actor_rollout_ref.actor.megatron, actor_rollout_ref.ref.megatron, critic.enable, critic.megatron,
    reward_model.enable, reward_model.megatron, trainer.nnodes, trainer.n_gpus_per_node, placement.mode,
    placement.rollout_gpus
    """
    arr = config.actor_rollout_ref
    roles = [("actor_rollout_ref.actor.megatron", arr.actor.megatron), ("actor_rollout_ref.ref.megatron", arr.ref.megatron)]
    if config.critic.enable:
        roles.append(("critic.megatron", config.critic.megatron))
    if config.reward_model.enable:
        roles.append(("reward_model.megatron", config.reward_model.megatron))
    for prefix, megatron in roles:
        yield from _expert_problems(prefix, megatron, sizes.train_gpus)
