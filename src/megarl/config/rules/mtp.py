"""Rules on multi-token prediction (`actor_rollout_ref.model.mtp`, verl's MtpConfig)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig, MtpConfig

KEY = "actor_rollout_ref.model.mtp"
# SGLang 0.5.23 drafts with the target checkpoint's own MTP layers (no --speculative-draft-model-path) for
# EAGLE and its alias NEXTN only (arg_groups/speculative_hook.py `_resolve_speculative_algorithm_alias`,
# `_handle_eagle_family`); it upper-cases the name first (`handle_speculative_decoding`).
MTP_ALGORITHMS = ("EAGLE", "NEXTN")
# SGLang 0.5.23 cannot draft on a CPU: its EAGLE worker hands the target's embedding and head to the draft
# model (speculative/eagle_worker_v2.py), whose `set_embed_and_head` calls torch.cuda.synchronize()
# (models/deepseek_v2.py DeepseekV2ForCausalLM, models/glm4_moe.py Glm4MoeForCausalLM), which raises there.
SGLANG_CPU_NO_DRAFT = ("SGLang 0.5.23 cannot draft on a CPU: its EAGLE worker shares the target's embedding and "
                       "head with the draft model through set_embed_and_head, which calls torch.cuda.synchronize() "
                       "(models/deepseek_v2.py, models/glm4_moe.py)")


def mtp_train_layout_problem(vpp: int, section: str) -> Optional[str]:
    """Why megarl cannot train the MTP layers at this layout of the actor, or None. Not built: virtual
    pipeline stages (megatron-core places the MTP block by virtual stage, multi_token_prediction.py
    `mtp_on_this_rank`, which megarl's chunk building does not follow). Context parallelism is built: megarl
    normalises the MTP loss by the whole micro-batch's tokens (megarl.engines.megatron.mtp `cp_token_normaliser`)."""
    if vpp <= 1:
        return None
    return (f"{KEY}.enable_train=true (with {section}.megatron.virtual_pipeline_model_parallel_size={vpp}): not "
            "built yet with virtual pipeline stages (megatron-core places the MTP block by virtual stage); megarl "
            "trains the MTP layers with tensor, pipeline, context and expert parallelism")


def mtp_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """With `mtp.enable` (verl reads nothing else without it): training the MTP layers (`enable_train`)
    without virtual pipeline stages or LoRA; drafting with them (`enable_rollout`)
    only on real SGLang on GPUs (SGLANG_CPU_NO_DRAFT), with an algorithm that drafts with the checkpoint's
    own MTP layers and positive speculative sizes; vLLM's
    `method` / `num_speculative_tokens` at verl's defaults (megarl serves with SGLang). That the checkpoint
    has MTP layers at all is checked against its config.json before any process starts
    (megarl.trainer.inputs.mtp_model_problem).

    Reads: actor_rollout_ref.model.mtp, actor_rollout_ref.model.lora.rank, actor_rollout_ref.rollout.name,
    trainer.device, actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size
    """
    mtp = config.actor_rollout_ref.model.mtp
    if not mtp.enable:
        return
    if mtp.enable_train:
        m = config.actor_rollout_ref.actor.megatron
        problem = mtp_train_layout_problem(m.virtual_pipeline_model_parallel_size or 1, "actor_rollout_ref.actor")
        if problem:
            yield problem
        if config.actor_rollout_ref.model.lora.rank > 0:
            yield (f"{KEY}.enable_train=true with actor_rollout_ref.model.lora.rank>0: not built (megarl's adapters "
                   "are not attached to the MTP layers, whose base weights the MTP loss would then leave frozen)")
    default = MtpConfig()
    for name in ("method", "num_speculative_tokens"):
        if getattr(mtp, name) != getattr(default, name):
            yield (f"{KEY}.{name}={getattr(mtp, name)!r}: vLLM's speculative decoding; megarl serves with SGLang, "
                   f"whose settings are {KEY}.speculative_*")
    if not mtp.enable_rollout:
        return
    if config.actor_rollout_ref.rollout.name == "cpu":
        yield (f"{KEY}.enable_rollout=true with actor_rollout_ref.rollout.name=cpu: megarl's CPU engine has no "
               "speculative decoding (no draft model); SGLang drafts with the MTP layers (rollout.name=sglang)")
    elif config.trainer.device == "cpu":
        yield f"{KEY}.enable_rollout=true with trainer.device=cpu: {SGLANG_CPU_NO_DRAFT}"
    if mtp.speculative_algorithm.upper() not in MTP_ALGORITHMS:
        yield (f"{KEY}.speculative_algorithm={mtp.speculative_algorithm!r}: SGLang 0.5.23 drafts with the "
               f"checkpoint's own MTP layers for {' or '.join(MTP_ALGORITHMS)} only (speculative_hook.py "
               "_handle_eagle_family); other algorithms need another draft model")
    for name in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens"):
        value = getattr(mtp, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            yield f"{KEY}.{name}={value!r}: a positive integer"
