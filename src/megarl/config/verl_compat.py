"""verl's keys and values that megarl accepts although its schema has no place for them.

A verl script (Hydra overrides, or a YAML file) names keys that select verl machinery megarl does
not have (FSDP, vLLM, remove-padding switches, mbridge). Each one here is either ignored or moved to
the megarl key that does the job, with one warning line saying what megarl does instead; any other
unknown key is still an error. Hydra's `--config-path/--config-name` are read in megarl.config.args.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from megarl.config.errors import ConfigError

log = logging.getLogger("megarl.config")


@dataclass(frozen=True)
class VerlKey:
    """What megarl does with a verl key: `target` takes its value (None: the value is dropped);
    `instead` is the sentence of the warning; `only`: the one value accepted (None: any), another
    is refused with `instead` as the reason."""

    instead: str
    target: Optional[str] = None
    only: Optional[Any] = None


_PACKED = "megarl always packs sequences without padding (THD layout with cu_seqlens)"
_MBRIDGE = "megarl converts HF <-> Megatron with its own bridge (megarl.bridge)"
_FSDP = "megarl trains with Megatron only; FSDP settings do not apply"
_SERVER = "megarl's rollout servers are always HTTP servers (SGLang protocol), which is verl's async server mode"
# Megatron-LM's --use-flash-attn (megatron/training/arguments.py), no field of megatron-core's TransformerConfig;
# verl passes it in override_transformer_config
_FLASH = ("use_flash_attn is Megatron-LM's command-line flag, not a field of megatron-core's TransformerConfig; "
          "megarl's GPU layers use transformer-engine attention, which picks flash attention where it can "
          "(override_transformer_config.attention_backend=flash forces it)")
_TRANSFORMER = ".megatron.override_transformer_config.use_flash_attn"

# Exact dotted paths; a path ending in ".*" covers every key under that group.
VERL_KEYS: dict[str, VerlKey] = {
    "actor_rollout_ref.model.use_remove_padding": VerlKey(_PACKED),
    "critic.model.use_remove_padding": VerlKey(_PACKED),
    "actor_rollout_ref.model.use_fused_kernels": VerlKey(
        "megarl computes log-probs from Megatron's logits with its own code; verl's fused kernels do not apply"),
    "actor_rollout_ref.model.use_shm": VerlKey("megarl reads the HF checkpoint from its path directly"),
    "actor_rollout_ref.actor.use_torch_compile": VerlKey("megarl does not torch.compile the Megatron model"),
    "actor_rollout_ref.actor.megatron.use_mbridge": VerlKey(_MBRIDGE),
    "actor_rollout_ref.ref.megatron.use_mbridge": VerlKey(_MBRIDGE),
    "critic.megatron.use_mbridge": VerlKey(_MBRIDGE),
    "actor_rollout_ref.actor.fsdp_config.*": VerlKey(_FSDP),
    "actor_rollout_ref.ref.fsdp_config.*": VerlKey(_FSDP),
    "critic.model.fsdp_config.*": VerlKey(_FSDP),
    "actor_rollout_ref.rollout.mode": VerlKey(_SERVER),
    "actor_rollout_ref.rollout.enable_chunked_prefill": VerlKey("SGLang chunks long prefills by its own default"),
    "actor_rollout_ref.rollout.load_format": VerlKey(
        "megarl's servers load the HF checkpoint at start and receive every update by weight sync"),
    "actor_rollout_ref.rollout.enforce_eager": VerlKey("SGLang decides CUDA graphs itself"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": VerlKey("SGLang sizes its batches from its memory budget"),
    # verl's rollout-correction guide asks for it with algorithm.rollout_correction
    "actor_rollout_ref.rollout.calculate_log_probs": VerlKey(
        "megarl's rollouts always return the sampled tokens' log-probs (batch key rollout_log_probs)"),
    "trainer.default_hdfs_dir": VerlKey("megarl writes checkpoints to trainer.default_local_dir only"),
    "trainer.del_local_ckpt_after_load": VerlKey("megarl keeps checkpoints (see trainer.max_actor_ckpt_to_keep)"),
    "ray_init.*": VerlKey("megarl starts or joins Ray itself (megarl.launch)"),
    # verl's Hydra defaults group choosing its actor/ref/critic base configs (dp: FSDP, megatron, ...)
    "model_engine": VerlKey("megarl trains with Megatron only; its schema defaults stand for verl's megatron "
                            "actor, ref and critic configs", only="megatron"),
    **{role + _TRANSFORMER: VerlKey(_FLASH) for role in (
        "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")},
    # verl's newer name for the learning-rate schedule
    "actor_rollout_ref.actor.optim.lr_scheduler_type": VerlKey(
        "megarl names the schedule warmup_style", "actor_rollout_ref.actor.optim.warmup_style"),
    "critic.optim.lr_scheduler_type": VerlKey("megarl names the schedule warmup_style", "critic.optim.warmup_style"),
}

# (key, verl value) -> (megarl value, what megarl does instead)
VERL_VALUES: dict[tuple[str, Any], tuple[Any, str]] = {
    ("actor_rollout_ref.rollout.name", "vllm"): (
        "sglang", "megarl's GPU rollout engine is SGLang (trainer.device=cpu uses rollout.name=cpu)"),
    ("actor_rollout_ref.rollout.name", "hf"): ("sglang", "megarl's GPU rollout engine is SGLang"),
    ("actor_rollout_ref.actor.strategy", "fsdp"): ("megatron", _FSDP),
    ("actor_rollout_ref.actor.strategy", "fsdp2"): ("megatron", _FSDP),
    ("critic.strategy", "fsdp"): ("megatron", _FSDP),
    ("critic.strategy", "fsdp2"): ("megatron", _FSDP),
    ("reward_model.strategy", "fsdp"): ("megatron", _FSDP),
    ("reward_model.strategy", "fsdp2"): ("megatron", _FSDP),
    # verl scripts pass `data.return_raw_chat=$return_raw_chat` with the variable unset: Hydra reads ''
    ("data.return_raw_chat", ""): (False, "an empty value is false, as in verl"),
}


def verl_key(path: str) -> Optional[VerlKey]:
    """The table's entry for dotted `path` (exact, or under a ".*" group), or None."""
    if path in VERL_KEYS:
        return VERL_KEYS[path]
    parts = path.split(".")
    for i in range(len(parts), 0, -1):  # the group itself, then the groups above it
        entry = VERL_KEYS.get(".".join(parts[:i]) + ".*")
        if entry is not None:
            return entry
    return None


def check_value(path: str, entry: VerlKey, value: Any, source: str) -> None:
    """Raise a ConfigError naming `path` if `entry` accepts one value only and `value` is another."""
    if entry.only is not None and value != entry.only:
        raise ConfigError(f"{path}={value} ({source}): {entry.instead}; megarl accepts {path}={entry.only} only")


def warn_key(path: str, entry: VerlKey, source: str) -> None:
    """The one warning line for a verl key."""
    action = f"its value goes to {entry.target}" if entry.target else "ignored"
    log.warning("%s (verl key, %s): %s; %s", path, source, entry.instead, action)


def pop_verl_keys(root: dict, origins: dict) -> None:
    """Remove the verl keys of a raw config tree (moving mapped ones to their target), in place,
    warning once each."""

    def walk(node: dict, prefix: str) -> None:
        for key in list(node):
            path = f"{prefix}{key}"
            entry = verl_key(path)
            if entry is not None:
                value = node.pop(key)
                check_value(path, entry, value, origins.get(path, "YAML"))
                warn_key(path, entry, origins.get(path, "YAML"))
                if entry.target is not None:
                    *groups, leaf = entry.target.split(".")
                    target = root
                    for part in groups:
                        target = target.setdefault(part, {})
                    target[leaf] = value
                    origins[entry.target] = f"verl key {path}"
            elif isinstance(node[key], dict):
                walk(node[key], path + ".")

    walk(root, "")


def map_verl_values(tree: dict, origins: dict) -> None:
    """Replace the verl values of VERL_VALUES in a raw config tree, in place, warning once each."""
    for (path, verl_value), (value, instead) in VERL_VALUES.items():
        *groups, leaf = path.split(".")
        node = tree
        for part in groups:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(leaf) == verl_value:
            node[leaf] = value
            log.warning("%s=%s (verl value, %s): %s; using %s", path, verl_value, origins.get(path, "YAML"),
                        instead, value)
