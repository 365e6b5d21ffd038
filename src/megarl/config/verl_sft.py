"""verl's engine-based SFT trainer keys (verl.trainer.sft_trainer) onto megarl's SFT.

verl's SFT config (verl/trainer/config/sft_trainer_engine.yaml) has top-level groups `model`
(model/hf_model.yaml), `engine` (engine/megatron.yaml) and `optim` (optim/megatron.yaml) beside
`data`, `trainer` and `checkpoint`; megarl's SFT (megarl.trainer.sft) reads the actor's keys. With
`load_config(..., verl_sft=True)` (megarl.trainer.sft_trainer, verl's module name) each override
goes through `sft_override` first: `engine.X` is `actor_rollout_ref.actor.megatron.X`, `optim.X`
`actor_rollout_ref.actor.optim.X`, `model.X` `actor_rollout_ref.model.X` (then megarl's reading of
verl's PPO keys applies, megarl.config.verl_compat); the keys below are renamed, accepted with one
warning (no meaning here) or refused with the reason.
"""
from __future__ import annotations

import logging

import yaml

from megarl.config.errors import ConfigError
from megarl.config.verl_compat import _NEVER, _PACKED, VerlKey, check_value, warn_key

log = logging.getLogger("megarl.config")

_NULL = object()  # `only` for a key whose one accepted value is null (a VerlKey without `only` accepts any)

# verl SFT group -> megarl's group (the rest of the path kept)
_MOVED = {"engine.": "actor_rollout_ref.actor.megatron.", "optim.": "actor_rollout_ref.actor.optim.",
          "model.": "actor_rollout_ref.model.", "checkpoint.": "actor_rollout_ref.actor.checkpoint."}

_RESHARD = ("megarl's checkpoints keep the distributed optimizer's state resharded over DP ranks (megatron's "
            "dp_reshardable); its other formats are not built")
_LORA = ("LoRA through verl's SFT keys is not built yet (verl's model.lora_rank / model.lora.*; megarl's LoRA is "
         "actor_rollout_ref.model.lora.*)")

# Exact verl SFT paths; a path ending in ".*" covers the keys under it. A `target` renames the key.
SFT_KEYS: dict[str, VerlKey] = {
    # Hydra's choices of verl's config groups
    "model": VerlKey("verl's model config group; megarl reads the HF checkpoint at model.path", only="hf_model"),
    "engine": VerlKey("megarl trains with Megatron only (verl's engine=megatron)", only="megatron"),
    "optim": VerlKey("megarl's optimizer is megatron-core's (verl's optim=megatron)", only="megatron"),
    # data (verl's MultiTurnSFTDataset and dataloader)
    "data.micro_batch_size_per_gpu": VerlKey("megarl names it actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    "data.use_dynamic_bsz": VerlKey("megarl names it actor_rollout_ref.actor.use_dynamic_bsz",
                                    "actor_rollout_ref.actor.use_dynamic_bsz"),
    "data.max_token_len_per_gpu": VerlKey("megarl names it actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
    "data.pad_mode": VerlKey(_PACKED + "; a chat is never padded, whichever pad_mode"),
    "data.use_shm": VerlKey("megarl reads the parquet files from their paths directly"),
    "data.num_workers": VerlKey("megarl tokenises the data once, in the driver, before training"),
    "data.balance_dp_token": VerlKey("balancing tokens over DP ranks is not built (verl: to be implemented)",
                                     only=False),
    "data.train_max_samples": VerlKey("training on the first rows only is not built yet", only=-1),
    "data.val_max_samples": VerlKey("validating on the first rows only is not built yet", only=-1),
    "data.tools_key": VerlKey("tool schemas in SFT chats are not built yet (a 'tools' column is refused)",
                              only="tools"),
    "data.enable_thinking_key": VerlKey("per-chat enable_thinking is not built yet (an 'enable_thinking' column is "
                                        "refused)", only="enable_thinking"),
    "data.enable_thinking_default": VerlKey("passing enable_thinking to the chat template is not built yet",
                                            only=_NULL),
    "data.custom_cls.*": VerlKey("a custom dataset class is not built yet", only=_NULL),
    # model (model/hf_model.yaml); the rest moves to actor_rollout_ref.model.*
    "model.tokenizer_path": VerlKey("megarl's SFT reads the tokenizer at data.tokenizer", "data.tokenizer"),
    "model.hf_config_path": VerlKey("megarl reads config.json beside the weights; another one is not built yet",
                                    only=_NULL),
    "model.custom_chat_template": VerlKey("a chat template other than the tokenizer's is not built yet", only=_NULL),
    "model.external_lib": VerlKey("importing a module that registers a model is not built yet", only=_NULL),
    "model.use_liger": VerlKey("Liger kernels patch HF models; megarl trains the Megatron model"),
    "model.fused_kernel_options.*": VerlKey("megarl computes log-probs from Megatron's logits with its own code"),
    "model.enable_activation_offload": VerlKey("activation offload is not built yet", only=False),
    "model.tiled_mlp.enabled": VerlKey("tiled MLP (an FSDP memory saver) is not built", only=False),
    "model.tiled_mlp.num_shards": VerlKey("read by verl only with model.tiled_mlp.enabled=true"),
    "model.lora_rank": VerlKey(_LORA, only=0),
    "model.lora_alpha": VerlKey("read by verl only with model.lora_rank > 0"),
    "model.target_modules": VerlKey("read by verl only with model.lora_rank > 0"),
    "model.exclude_modules": VerlKey("read by verl only with model.lora_rank > 0"),
    "model.lora_adapter_path": VerlKey(_LORA, only=_NULL),
    "model.lora.rank": VerlKey(_LORA, only=0),
    "model.lora.*": VerlKey("read by verl only with model.lora.rank > 0"),
    # model.mtp.{enable, enable_train, detach_encoder, mtp_loss_scaling_factor}: moved, trained as the actor's
    "model.mtp.enable_rollout": VerlKey("an SFT run has no rollout", only=False),
    "model.mtp.speculative_algorithm": VerlKey("an SFT run has no rollout"),
    "model.mtp.speculative_num_steps": VerlKey("an SFT run has no rollout"),
    "model.mtp.speculative_eagle_topk": VerlKey("an SFT run has no rollout"),
    "model.mtp.speculative_num_draft_tokens": VerlKey("an SFT run has no rollout"),
    "model.mtp.method": VerlKey("an SFT run has no rollout"),
    "model.mtp.num_speculative_tokens": VerlKey("an SFT run has no rollout"),
    # engine (engine/megatron.yaml); the rest moves to actor_rollout_ref.actor.megatron.* (use_mbridge, dtype,
    # use_dist_checkpointing, use_megatron_fsdp, qat.*, ...: as verl's PPO keys there)
    "engine.pad_bshd_to_minibatch_max": VerlKey(_PACKED),
    "engine.pad_to_length": VerlKey(_PACKED),
    "engine.pad_to_length_bucket": VerlKey(_PACKED),
    "engine.forward_only": VerlKey("an SFT trainer trains", only=False),
    "engine.entropy_from_logits_with_chunking": VerlKey("megarl's SFT computes no entropy"),
    "engine.entropy_from_logits_chunk_size": VerlKey("megarl's SFT computes no entropy"),
    "engine.dynamic_context_parallel": VerlKey("dynamic context parallelism is not built yet", only=False),
    "engine.max_seqlen_per_dp_cp_rank": VerlKey("read by verl only with engine.dynamic_context_parallel=true"),
    "engine.dist_checkpointing_prefix": VerlKey("read by verl only with engine.use_dist_checkpointing=true"),
    "engine.dist_ckpt_optim_fully_reshardable": VerlKey(_RESHARD),
    "engine.distrib_optim_fully_reshardable_mem_efficient": VerlKey(_RESHARD),
    "engine.override_ddp_config.*": VerlKey("overriding megatron-core's DistributedDataParallelConfig is not built "
                                            "yet", only=_NEVER),
    "engine.override_mcore_model_config.*": VerlKey("overriding megatron's model config is not built yet "
                                                    "(engine.override_transformer_config is)", only=_NEVER),
    "engine.router_replay.mode": VerlKey("routing replay replays a rollout's expert choices; SFT has no rollout",
                                         only="disabled"),
    "engine.router_replay.*": VerlKey("read by verl only with a routing replay mode"),
    # optim (optim/megatron.yaml); the rest moves to actor_rollout_ref.actor.optim.*
    "optim.lr_warmup_init": VerlKey("megarl's warm-up starts from 0 (megatron's OptimizerParamScheduler init_lr=0); "
                                    "another start is not built yet", only=0.0),
    "optim.weight_decay_incr_style": VerlKey("megarl's weight decay is constant", only="constant"),
    "optim.lr_wsd_decay_style": VerlKey("read by verl only with lr_decay_style=WSD, which megarl does not build"),
    "optim.lr_wsd_decay_steps": VerlKey("read by verl only with lr_decay_style=WSD, which megarl does not build"),
    "optim.use_checkpoint_opt_param_scheduler": VerlKey(
        "megarl resumes the learning-rate schedule from the run's own settings (megatron's OptimizerParamScheduler "
        "checks a checkpoint's against them); taking the checkpoint's instead is not built", only=False),
    "optim.use_layer_wise_distributed_optimizer": VerlKey("the layer-wise distributed optimizer is not built yet",
                                                          only=False),
    "optim.main_grads_dtype": VerlKey("precision-aware optimizer dtypes other than fp32 are not built yet",
                                      only="fp32"),
    "optim.exp_avg_dtype": VerlKey("precision-aware optimizer dtypes other than fp32 are not built yet",
                                   only="fp32"),
    "optim.exp_avg_sq_dtype": VerlKey("precision-aware optimizer dtypes other than fp32 are not built yet",
                                      only="fp32"),
    # trainer and checkpoint
    "trainer.max_ckpt_to_keep": VerlKey("megarl names it trainer.max_actor_ckpt_to_keep",
                                        "trainer.max_actor_ckpt_to_keep"),
    "trainer.profile_interval": VerlKey("profiling is not built yet", only=[-1, -1]),
    "profiler.*": VerlKey("profiling is not built yet", only=_NEVER),
}
# optim.muon_*: Muon's settings (optim/megatron.yaml)
_MUON = VerlKey("read by verl only with optim.optimizer=muon, which megarl does not build (adam, sgd)")
# keys whose values are read here, not by one rule of the table
_SPECIAL = ("data.train_batch_size", "trainer.save_freq", "trainer.logger", "optim.use_precision_aware_optimizer")


def _split(text: str) -> tuple[str, str, str, object]:
    """('+' or '++' or '', dotted key, raw value, parsed value) of an override."""
    plus = text[: len(text) - len(text.lstrip("+"))]
    key, _, raw = text[len(plus):].partition("=")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return plus, key, raw, value


def _entry(path: str) -> VerlKey | None:
    if path.startswith("optim.muon_"):
        return _MUON
    if path in SFT_KEYS:
        return SFT_KEYS[path]
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        entry = SFT_KEYS.get(".".join(parts[:i]) + ".*")
        if entry is not None:
            return entry
    return None


def _special(plus: str, path: str, raw: str, value, source: str) -> list[str]:
    if path == "data.train_batch_size":  # one optimizer step per batch: megarl's mini-batch is the whole batch
        return [f"{plus}data.train_batch_size={raw}", f"actor_rollout_ref.actor.ppo_mini_batch_size={raw}"]
    if path == "trainer.save_freq":  # megarl's SFT saves as verl's (megarl.trainer.sft)
        if value == "after_each_epoch":  # verl/trainer/sft_trainer.py _init_engine: the steps of an epoch
            raise ConfigError(f"{path}={value} ({source}): saving after each epoch by name is not built yet; give "
                              "the steps of an epoch (rows / data.train_batch_size)")
        return [f"{plus}{path}={raw}"]
    if path == "trainer.logger":  # verl's file logger: JSON lines of the metrics, which megarl always writes
        loggers = value if isinstance(value, list) else [value]
        if "file" in loggers:
            log.warning("trainer.logger: file (verl logger, %s): megarl always writes the metrics as JSON lines to "
                        "<trainer.default_local_dir>/<project>/<experiment>/logs/metrics.jsonl; dropped", source)
        return [f"{plus}trainer.logger={[x for x in loggers if x != 'file']}"]
    # optim.use_precision_aware_optimizer: a field of megatron-core's OptimizerConfig
    return [f"+actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer={raw}"]


def sft_override(text: str) -> list[str]:
    """The megarl overrides for one override of verl's SFT trainer (`text` itself where it is no SFT
    key of verl's); one warning for a key without meaning here, ConfigError for one megarl cannot
    honour, naming the override."""
    plus, path, raw, value = _split(text)
    source = f"override '{text}'"
    if path in _SPECIAL:
        return _special(plus, path, raw, value, source)
    entry = _entry(path)
    if entry is not None:
        if entry.only is _NULL and value is not None:
            raise ConfigError(f"{path}={value} ({source}): {entry.instead}; megarl accepts {path}=null only")
        if entry.only is not _NULL:
            check_value(path, entry, value, source)
        warn_key(path, entry, source)
        return [] if entry.target is None else [f"{plus}{entry.target}={raw}"]
    for verl_group, megarl_group in _MOVED.items():
        if path.startswith(verl_group):
            return [f"{plus}{megarl_group}{path.removeprefix(verl_group)}={raw}"]
    return [text]

