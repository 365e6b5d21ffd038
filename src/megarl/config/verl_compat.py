"""verl's keys and values that megarl accepts although its schema has no place for them.

A verl script (Hydra overrides, or a YAML file) names keys that select verl machinery megarl does
not have (FSDP, vLLM, remove-padding switches, mbridge). Each one here is either ignored or moved to
the megarl key that does the job, with one warning line saying what megarl does instead; any other
unknown key is still an error. Hydra's `--config-path/--config-name` are read in megarl.config.args.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

from megarl.config.errors import ConfigError

log = logging.getLogger("megarl.config")


@dataclass(frozen=True)
class VerlKey:
    """What megarl does with a verl key: `target` takes its value (None: the value is dropped);
    `instead` is the sentence of the warning; `only`: the one value accepted (None: any), another
    is refused with `instead` as the reason; `grouped`: see below."""

    instead: str
    target: Optional[str] = None
    only: Optional[Any] = None
    # the value is kept for `resolve_verl_groups`, which reads it with the other keys of its group
    # (a verl setting spread over several keys, or one whose meaning depends on the entry point)
    grouped: bool = False


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

_MEGATRON_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")
_OPTIMS = ("actor_rollout_ref.actor.optim", "critic.optim")
_NEVER = object()
# the keys verl's own default override_transformer_config defines (verl/trainer/config/engine/megatron.yaml),
# so that verl's scripts override them without '+'
VERL_TRANSFORMER_DEFAULTS = ("recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers",
                             "attention_backend")  # `only` for a key that no value makes acceptable

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
    # verl's RolloutConfig.enable_sleep_mode (verl/workers/config/rollout.py, default true): its vLLM and TRT-LLM
    # servers' sleep mode (vllm_async_server.py `enable_sleep_mode`, trtllm_async_server.py `SleepConfig`); verl's
    # SGLang server does not read it (async_sglang_server.py releases memory by free_cache_engine)
    "actor_rollout_ref.rollout.enable_sleep_mode": VerlKey(
        "verl's vLLM / TRT-LLM sleep mode; megarl's SGLang servers colocated on GPUs start with --enable-memory-saver "
        "and release their memory while the trainer runs as actor_rollout_ref.rollout.free_cache_engine says"),
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
    # verl's newer spelling of ray_init (verl/trainer/config/ppo_trainer.yaml `ray_kwargs.ray_init`); its
    # runtime_env.py_executable (the interpreter of Ray's workers, e.g. `uv run ...`) means nothing here:
    # megarl's workers run the driver's own Python
    # verl passes ray_kwargs.ray_init.runtime_env to ray.init (verl/trainer/main_ppo.py `run_ppo`): its
    # env_vars reach every Ray worker, as megarl's trainer.worker_env do
    "ray_kwargs.ray_init.runtime_env.env_vars.*": VerlKey(
        "Ray's job-level environment variables of every worker", "trainer.worker_env", grouped=True),
    "ray_kwargs.*": VerlKey("megarl starts or joins Ray itself (megarl.launch) and its workers run the driver's "
                            "own Python; Ray's runtime_env (py_executable) and init arguments do not apply"),
    **{f"{role}.megatron.vanilla_mbridge": VerlKey(_MBRIDGE) for role in _MEGATRON_ROLES},
    **{f"{role}.megatron.use_remove_padding": VerlKey(_PACKED) for role in _MEGATRON_ROLES},
    # verl's engine dtype of a Megatron role (verl/trainer/config/engine/megatron.yaml `dtype`): megarl
    # trains every role in actor_rollout_ref.model.dtype
    **{f"{role}.megatron.dtype": VerlKey("megarl trains every role in actor_rollout_ref.model.dtype",
                                         "actor_rollout_ref.model.dtype") for role in _MEGATRON_ROLES},
    "actor_rollout_ref.actor.model_engine": VerlKey(
        "megarl trains with Megatron only; its schema defaults stand for verl's megatron actor", only="megatron"),
    # the rollout's parallel sizes that verl reads with tensor_model_parallel_size / expert_parallel_size:
    # resolve_verl_groups (_rollout_parallel)
    "actor_rollout_ref.rollout.data_parallel_size": VerlKey("", grouped=True),
    "actor_rollout_ref.rollout.moe_tensor_parallel_size": VerlKey("", grouped=True),
    # a key verl's config never had (verl/trainer/config/rollout/rollout.yaml, verl/workers/config/rollout.py
    # RolloutConfig at 2026-08-22 and in 0.9.1); its one script
    # (fully_async_policy/shell/grpo_qwen35_35b_megatron_async.sh) sets it without '+', which Hydra refuses:
    # "Could not override '...'. Key '...' is not in struct"
    "actor_rollout_ref.rollout.single_turn_response_length": VerlKey(
        "verl too: no such key in verl's rollout config (verl/trainer/config/rollout/rollout.yaml), so Hydra refuses "
        "the override (\"Key 'single_turn_response_length' is not in struct\"); the response length is "
        "actor_rollout_ref.rollout.response_length (data.max_response_length)", only=_NEVER),
    # verl's multi-turn settings (verl/workers/config/rollout.py MultiTurnConfig): _multi_turn
    "actor_rollout_ref.rollout.multi_turn.*": VerlKey("", grouped=True),
    # verl's agent loop worker processes (verl/experimental/agent_loop/agent_loop.py
    # AgentLoopManager._init_agent_loop_workers: that many Ray actors run the agent loops)
    "actor_rollout_ref.rollout.agent.num_workers": VerlKey(
        "megarl runs agent episodes as asyncio tasks of the trainer's process, at most "
        "actor_rollout_ref.rollout.agent.max_concurrent_episodes at once; verl's agent loop worker processes do not "
        "apply"),
    "data.filter_overlong_prompts_workers": VerlKey("megarl filters the prompts in one process"),
    "actor_rollout_ref.ref.use_torch_compile": VerlKey("megarl does not torch.compile the Megatron model"),
    # verl's router replay key under the engine config (engine/megatron.yaml `router_replay.mode`)
    "actor_rollout_ref.actor.megatron.router_replay.mode": VerlKey(
        "megarl names it actor_rollout_ref.actor.router_replay.mode", "actor_rollout_ref.actor.router_replay.mode"),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": VerlKey(
        "megarl's servers return the routed experts whenever actor_rollout_ref.actor.router_replay.mode=R3 "
        "(SGLang's --enable-return-routed-experts)"),
    "actor_rollout_ref.rollout.skip_tokenizer_init": VerlKey(
        "megarl sends SGLang token ids and reads the generated token ids, whichever way the server loads its "
        "tokenizer"),
    "actor_rollout_ref.rollout.disable_log_stats": VerlKey("SGLang's own logging defaults stand"),
    # verl's name for the servers' concurrent sequences (vLLM max_num_seqs; SGLang --max-running-requests)
    "actor_rollout_ref.rollout.max_num_seqs": VerlKey(
        "megarl names it actor_rollout_ref.rollout.max_concurrent_requests (SGLang's --max-running-requests)",
        "actor_rollout_ref.rollout.max_concurrent_requests"),
    "actor_rollout_ref.rollout.max_model_len": VerlKey("", grouped=True),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": VerlKey(
        "megarl names it actor_rollout_ref.rollout.update_weights_bucket_megabytes",
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes"),
    "actor_rollout_ref.rollout.checkpoint_engine.backend": VerlKey(
        "megarl picks the weight transport from actor_rollout_ref.rollout.weight_sync_transport"),
    # verl's tokenizer/processor flag of the dataset; megarl loads the tokenizer with the model's flag
    "data.trust_remote_code": VerlKey("megarl loads the tokenizer with actor_rollout_ref.model.trust_remote_code",
                                      "actor_rollout_ref.model.trust_remote_code"),
    # verl's Megatron learning-rate schedule (optim/megatron.yaml): the decay style and length
    **{f"{optim}.lr_decay_style": VerlKey("megarl names the decay style warmup_style", f"{optim}.warmup_style")
       for optim in _OPTIMS},
    # the DAPO reward of verl's newer scripts (reward.reward_manager.name, reward.reward_kwargs) and of
    # verl-recipe's (reward_model.reward_kwargs): megarl's reward_model.reward_manager / overlong_* keys
    "reward.reward_manager.name": VerlKey("megarl names it reward_model.reward_manager",
                                          "reward_model.reward_manager"),
    "reward.reward_kwargs.*": VerlKey("", grouped=True),
    "reward_model.reward_kwargs.*": VerlKey("", grouped=True),
    # verl's fully async / one-step-off keys (verl/experimental/*/config/*.yaml): resolve_verl_groups
    "actor_rollout_ref.hybrid_engine": VerlKey("", grouped=True),
    "rollout.nnodes": VerlKey("", grouped=True),
    "rollout.n_gpus_per_node": VerlKey("", grouped=True),
    "rollout.total_rollout_steps": VerlKey("", grouped=True),
    "async_training.staleness_threshold": VerlKey("", grouped=True),
    "async_training.trigger_parameter_sync_step": VerlKey("", grouped=True),
    "async_training.require_batches": VerlKey("", grouped=True),
    "async_training.use_trainer_do_validate": VerlKey("megarl validates in the trainer's loop", only=False),
    # verl's on-policy distillation schema (verl/trainer/config/distillation/distillation.yaml)
    "distillation.teacher_models.*": VerlKey("", grouped=True),
    "distillation.distillation_loss.*": VerlKey("", grouped=True),
    "distillation.nnodes": VerlKey("", grouped=True),
    "distillation.n_gpus_per_node": VerlKey("", grouped=True),
    # verl's Hydra defaults group choosing its actor/ref/critic base configs (dp: FSDP, megatron, ...)
    "model_engine": VerlKey("megarl trains with Megatron only; its schema defaults stand for verl's megatron "
                            "actor, ref and critic configs", only="megatron"),
    **{role + _TRANSFORMER: VerlKey(_FLASH) for role in (
        "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")},
    # SGLang's radix cache through verl's engine_kwargs: megarl's own key (resolve_verl_groups)
    "actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cache": VerlKey("", grouped=True),
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
    ("actor_rollout_ref.rollout.name", "trtllm"): ("sglang", "megarl's GPU rollout engine is SGLang"),
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
    if entry.only is _NEVER:
        raise ConfigError(f"{path}={value} ({source}): {entry.instead}")
    if entry.only is not None and value != entry.only:
        raise ConfigError(f"{path}={value} ({source}): {entry.instead}; megarl accepts {path}={entry.only} only")


def warn_key(path: str, entry: VerlKey, source: str) -> None:
    """The one warning line for a verl key."""
    action = f"its value goes to {entry.target}" if entry.target else "ignored"
    log.warning("%s (verl key, %s): %s; %s", path, source, entry.instead, action)


def _entries_beneath(path: str) -> bool:
    """Whether the table has an entry for a key below `path` other than `path`'s own ".*" group."""
    return any(k.startswith(path + ".") and k != path + ".*" for k in VERL_KEYS)


def pop_verl_keys(root: dict, origins: dict, grouped: dict) -> None:
    """Remove the verl keys of a raw config tree (moving mapped ones to their target, grouped ones
    into `grouped`), in place, warning once each."""

    def walk(node: dict, prefix: str) -> None:
        for key in list(node):
            path = f"{prefix}{key}"
            entry = verl_key(path)
            if isinstance(node[key], dict) and node[key] and _entries_beneath(path):
                walk(node[key], path + ".")  # e.g. ray_kwargs: its env_vars mean more than ray_kwargs.*
                if not node[key]:
                    del node[key]
            elif entry is not None:
                value = node.pop(key)
                if entry.grouped:
                    grouped.update({f"{path}.{sub}" if sub else path: (v, origins.get(path, "YAML"))
                                    for sub, v in _flat(value)})
                    continue
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


def _flat(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted sub-path, leaf) of a YAML value: ("", value) for a leaf."""
    if not isinstance(value, dict) or not value:
        return [(prefix, value)]
    return [pair for k, v in value.items() for pair in _flat(v, f"{prefix}.{k}" if prefix else k)]


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


# --------------------------------------------------------------------------------------------
# verl settings spread over several keys (VerlKey.grouped): read together once every override is in
# --------------------------------------------------------------------------------------------
def _get(tree: dict, path: str, default: Any = None) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _set(tree: dict, path: str, value: Any, origins: dict, source: str) -> None:
    *groups, leaf = path.split(".")
    node = tree
    for part in groups:
        node = node.setdefault(part, {})
    node[leaf] = value
    origins[path] = source


def _under(grouped: dict, prefix: str) -> dict[str, tuple[Any, str]]:
    """The grouped keys under `prefix` (with its trailing dot), by the rest of their path."""
    return {path[len(prefix):]: v for path, v in grouped.items() if path.startswith(prefix)}


def _max_model_len(tree: dict, grouped: dict, origins: dict) -> list[str]:
    if "actor_rollout_ref.rollout.max_model_len" not in grouped:
        return []
    value, source = grouped["actor_rollout_ref.rollout.max_model_len"]
    rollout = tree["actor_rollout_ref"]["rollout"]
    need = (rollout.get("prompt_length") or _get(tree, "data.max_prompt_length")) + \
        (rollout.get("response_length") or _get(tree, "data.max_response_length"))
    if value is None:
        return []
    if not isinstance(value, int) or value < need:
        # the engine refuses a request longer than its context (SGLang: --context-length)
        return [f"actor_rollout_ref.rollout.max_model_len={value} ({source}): the rollout engine's context must hold a "
                f"prompt and its response, {need} tokens (the server refuses longer requests)"]
    log.warning("actor_rollout_ref.rollout.max_model_len=%s (verl key, %s): megarl sets SGLang's --context-length to "
                "prompt + response length (%s tokens), which every request fits; ignored", value, source, need)
    return []


# verl's DAPORewardManager(max_resp_len, overlong_buffer_cfg) (verl/workers/reward_manager/dapo.py): its only kwargs
_REWARD_KWARGS = ("overlong_buffer_cfg.enable", "overlong_buffer_cfg.len", "overlong_buffer_cfg.penalty_factor",
                  "overlong_buffer_cfg.log", "max_resp_len")


def _reward_kwargs(tree: dict, grouped: dict, origins: dict) -> list[str]:
    """verl's DAPO overlong shaping (`reward.reward_kwargs` / `reward_model.reward_kwargs`) onto megarl's
    reward_model.overlong_buffer_len / overlong_penalty_factor (megarl.algos.overlong_penalty: verl's formula,
    from data.max_response_length)."""
    errors = []
    for prefix in ("reward.reward_kwargs.", "reward_model.reward_kwargs."):
        kwargs = _under(grouped, prefix)
        if not kwargs:
            continue
        for name, (value, source) in kwargs.items():
            if name not in _REWARD_KWARGS:
                errors.append(f"{prefix}{name} ({source}): verl's DAPO reward manager takes "
                              f"{', '.join(_REWARD_KWARGS)} only (any other keyword fails its constructor)")
        enable = kwargs.get("overlong_buffer_cfg.enable", (False, ""))[0]
        where = kwargs.get("overlong_buffer_cfg.enable", (None, "verl's default"))[1]
        if enable:
            length = kwargs.get("overlong_buffer_cfg.len", (None, ""))[0]
            if not isinstance(length, int) or length < 1:
                errors.append(f"{prefix}overlong_buffer_cfg.len={length}: the overlong buffer needs a length in tokens")
                continue
            _set(tree, "reward_model.overlong_buffer_len", length, origins, f"verl key {prefix}overlong_buffer_cfg.len")
            if "overlong_buffer_cfg.penalty_factor" in kwargs:
                _set(tree, "reward_model.overlong_penalty_factor", kwargs["overlong_buffer_cfg.penalty_factor"][0],
                     origins, f"verl key {prefix}overlong_buffer_cfg.penalty_factor")
        else:
            _set(tree, "reward_model.overlong_buffer_len", 0, origins, f"verl key {prefix}overlong_buffer_cfg.enable")
        max_resp = kwargs.get("max_resp_len", (None, ""))[0]
        response = _get(tree, "data.max_response_length")
        if enable and max_resp is not None and max_resp != response:
            errors.append(f"{prefix}max_resp_len={max_resp}: megarl's overlong penalty counts from "
                          f"data.max_response_length={response}; a different length is not built yet")
        log.warning("%s* (verl keys, %s): DAPO's overlong shaping goes to reward_model.overlong_buffer_len / "
                    "overlong_penalty_factor (max_resp_len is data.max_response_length; overlong_buffer_cfg.log: megarl "
                    "logs reward/overlong_penalty_mean whenever the penalty is on)", prefix, where)
    return errors


def _add_pool(tree: dict, origins: dict, group: str, nodes: int, per_node: int) -> str | None:
    """Grow megarl's cluster (trainer.nnodes x trainer.n_gpus_per_node, every GPU of the run) by verl's
    resource pool `group`.nnodes x `group`.n_gpus_per_node, which verl places beside the trainer's pool:
    nodes of the same size add nodes; as many nodes as the trainer's share them (each node holds both
    pools' GPUs, e.g. verl's 6 + 2 on one 8-GPU node). The problem, if the pools fit neither way."""
    t_nodes, t_per_node = _get(tree, "trainer.nnodes"), _get(tree, "trainer.n_gpus_per_node")
    source = f"verl keys {group}.nnodes / {group}.n_gpus_per_node beside trainer.nnodes / trainer.n_gpus_per_node"
    if per_node == t_per_node:
        _set(tree, "trainer.nnodes", t_nodes + nodes, origins, source)
    elif nodes == t_nodes:
        _set(tree, "trainer.n_gpus_per_node", t_per_node + per_node, origins, source)
    else:
        return (f"{group}.nnodes={nodes} x {group}.n_gpus_per_node={per_node} beside trainer.nnodes={t_nodes} x "
                f"trainer.n_gpus_per_node={t_per_node}: megarl's cluster is trainer.nnodes nodes of "
                "trainer.n_gpus_per_node GPUs each, so the pools need nodes of one size or as many nodes")
    log.warning("%s.nnodes=%s x %s.n_gpus_per_node=%s (verl keys): the cluster is now trainer.nnodes=%s x "
                "trainer.n_gpus_per_node=%s, the trainer's pool and this one", group, nodes, group, per_node,
                _get(tree, "trainer.nnodes"), _get(tree, "trainer.n_gpus_per_node"))
    return None


_ASYNC_KEYS = ("rollout.nnodes", "rollout.n_gpus_per_node", "rollout.total_rollout_steps",
               "async_training.staleness_threshold", "async_training.trigger_parameter_sync_step",
               "async_training.require_batches")
# verl's defaults for them (verl/experimental/fully_async_policy/config/fully_async_ppo_megatron_trainer.yaml)
ASYNC_DEFAULTS = {"async_training.staleness_threshold": 0.1, "async_training.trigger_parameter_sync_step": 4,
                  "async_training.require_batches": 1}
FULLY_ASYNC_MODULE = "megarl.experimental.fully_async_policy.fully_async_main"
ONE_STEP_OFF_MODULE = "megarl.experimental.one_step_off_policy.main_ppo"


def _async(tree: dict, grouped: dict, origins: dict) -> list[str]:
    """verl's fully async / one-step-off keys onto async_training.mode's megarl keys:
    - hybrid_engine=false with rollout.nnodes x rollout.n_gpus_per_node rollout GPUs (verl: a pool beside the
      trainer's trainer.nnodes x trainer.n_gpus_per_node): placement.mode=split, placement.rollout_gpus, and
      trainer.nnodes counting both pools (megarl's trainer.* is the whole cluster);
    - fully async: a training step of require_batches x ppo_mini_batch_size prompts and a weight sync every
      trigger_parameter_sync_step steps is megarl's step of data.train_batch_size = their product prompts
      (the same optimizer steps per weight version); staleness_threshold (a fraction of a version's samples
      generated ahead) bounds staleness at ceil(threshold) versions (async_training.max_staleness, >= 1);
      total_rollout_steps prompts are total_rollout_steps // train_batch_size steps."""
    mode = _get(tree, "async_training.mode")
    present = {k: grouped[k] for k in (*_ASYNC_KEYS, "actor_rollout_ref.hybrid_engine") if k in grouped}
    if not present:
        return []
    hybrid = present.get("actor_rollout_ref.hybrid_engine", (True, ""))[0]
    if mode == "sync":
        named = [k for k in present if not (k == "actor_rollout_ref.hybrid_engine" and hybrid)]
        if named:
            return [f"{', '.join(named)} ({present[named[0]][1]}): verl's fully async / one-step-off keys; they mean "
                    f"something with {FULLY_ASYNC_MODULE} or {ONE_STEP_OFF_MODULE} (verl's module names with megarl "
                    "for verl), or async_training.mode=fully_async|one_step_off; this run is synchronous"]
        return []
    errors = []
    if hybrid:
        errors.append(f"actor_rollout_ref.hybrid_engine=true with async_training.mode={mode}: verl's {mode} trainer "
                      "needs its rollout on GPUs of their own (hybrid_engine=false and rollout.nnodes / "
                      "rollout.n_gpus_per_node)")
    nodes = present.get("rollout.nnodes", (None, ""))[0]
    per_node = present.get("rollout.n_gpus_per_node", (None, ""))[0]
    if nodes is not None or per_node is not None:
        nodes = 1 if nodes is None else nodes
        per_node = 8 if per_node is None else per_node
        problem = _add_pool(tree, origins, "rollout", nodes, per_node)
        if problem:
            errors.append(problem)
        else:
            _set(tree, "placement.mode", "split", origins, "verl keys rollout.nnodes / rollout.n_gpus_per_node")
            _set(tree, "placement.rollout_gpus", nodes * per_node, origins,
                 "verl keys rollout.nnodes x rollout.n_gpus_per_node")
    if mode == "fully_async":
        values = {k: present.get(k, (ASYNC_DEFAULTS.get(k), "verl's default"))[0] for k in _ASYNC_KEYS}
        mini = _get(tree, "actor_rollout_ref.actor.ppo_mini_batch_size")
        require, trigger = values["async_training.require_batches"], values["async_training.trigger_parameter_sync_step"]
        batch = require * trigger * mini
        _set(tree, "data.train_batch_size", batch, origins, "verl keys async_training.require_batches x "
             "trigger_parameter_sync_step x actor_rollout_ref.actor.ppo_mini_batch_size")
        staleness = values["async_training.staleness_threshold"]
        _set(tree, "async_training.max_staleness", max(1, math.ceil(staleness)), origins,
             "verl key async_training.staleness_threshold")
        total = values["rollout.total_rollout_steps"]
        if total is not None:
            _set(tree, "trainer.total_training_steps", max(1, total // batch), origins,
                 "verl key rollout.total_rollout_steps")
        if _get(tree, "data.gen_batch_size") is not None:  # verl's rollouter's fetch size (1 only); none here
            _set(tree, "data.gen_batch_size", None, origins, "fully async")
        log.warning("async_training (verl keys): a step trains data.train_batch_size=%s prompts (require_batches=%s x "
                    "trigger_parameter_sync_step=%s x ppo_mini_batch_size=%s) and then pushes the weights; "
                    "async_training.max_staleness=%s (staleness_threshold=%s)%s", batch, require, trigger, mini,
                    max(1, math.ceil(staleness)), staleness,
                    "" if total is None else f"; trainer.total_training_steps={max(1, total // batch)} "
                    f"(total_rollout_steps={total} prompts)")
    elif any(k.startswith("async_training.") or k == "rollout.total_rollout_steps" for k in present):
        named = [k for k in present if k.startswith("async_training.") or k == "rollout.total_rollout_steps"]
        errors.append(f"{', '.join(named)}: verl's fully async keys; async_training.mode={mode} does not read them")
    return errors


# verl 0.9.1's trainer/config/distillation/distillation.yaml, where megarl's defaults differ
VERL_DISTILLATION_DEFAULTS = {"loss_mode": "k3", "use_policy_gradient": False}


def _distillation(tree: dict, grouped: dict, origins: dict) -> list[str]:
    """verl's on-policy distillation schema (distillation/distillation.yaml) onto megarl's OPD
    (megarl.algos.opd, scored by the teacher on Megatron): distillation_loss.{loss_mode,
    use_policy_gradient, topk, loss_max_clamp, log_prob_min_clamp} are megarl's distillation.* keys of
    the same names, at verl's defaults (k3, false, 32, null, null) where the script leaves them."""
    teachers: dict[str, dict] = {}
    for path, (value, source) in _under(grouped, "distillation.teacher_models.").items():
        name, _, rest = path.partition(".")
        teachers.setdefault(name, {})[rest] = (value, source)
    loss = _under(grouped, "distillation.distillation_loss.")
    pool = {k: grouped[f"distillation.{k}"] for k in ("nnodes", "n_gpus_per_node") if f"distillation.{k}" in grouped}
    if not (teachers or loss or pool):
        return []
    errors = []
    if len(teachers) > 1:
        errors.append(f"distillation.teacher_models: {', '.join(teachers)}: megarl's OPD has one teacher; verl's "
                      "routing of samples to several teachers (teacher_key) is not built yet")
    for name, keys in teachers.items():
        for rest, (value, source) in keys.items():
            path = f"distillation.teacher_models.{name}.{rest}"
            if rest == "model_path":
                _set(tree, "distillation.teacher.model_path", value, origins, f"verl key {path}")
            elif rest == "inference.tensor_model_parallel_size":
                _set(tree, "distillation.teacher.megatron.tensor_model_parallel_size", value, origins, f"verl key {path}")
            elif rest == "key" and value is not None:
                errors.append(f"{path}={value}: routing samples to teachers by key is not built yet (one teacher)")
            elif rest.startswith("inference.") or rest in ("num_replicas", "key"):
                log.warning("%s (verl key, %s): megarl scores with the teacher on Megatron (distillation.type=megatron), "
                            "its layout distillation.teacher.megatron.*; verl's inference-server settings do not apply; "
                            "ignored", path, source)
            else:
                errors.append(f"{path}: not a key of verl's teacher model config (model_path, key, num_replicas, "
                              "inference.*)")
    for name in ("loss_mode", "use_policy_gradient"):  # verl's yaml defaults differ from megarl's
        if name not in loss and f"distillation.{name}" not in origins:  # nor given under megarl's own key
            _set(tree, f"distillation.{name}", VERL_DISTILLATION_DEFAULTS[name], origins,
                 f"verl's default of distillation.distillation_loss.{name}")
    task_rewards = loss.get("use_task_rewards", (True, "verl's default"))[0]
    for name, (value, source) in loss.items():
        path = f"distillation.distillation_loss.{name}"
        if name in ("use_task_rewards", "loss_mode", "use_policy_gradient", "topk", "loss_max_clamp",
                    "log_prob_min_clamp"):
            _set(tree, f"distillation.{name}", value, origins, f"verl key {path}")
        elif name == "distillation_loss_coef":
            if task_rewards:
                _set(tree, "distillation.kl_coef", value, origins, f"verl key {path}")
            else:  # verl's distillation_ppo_loss: the coefficient 1.0 without task rewards
                log.warning("%s=%s (verl key, %s): verl uses it with use_task_rewards=true only; ignored",
                            path, value, source)
        elif name in ("use_chunked_topk", "chunked_topk_chunk_size"):
            log.warning("%s=%s (verl key, %s): megarl's log-prob head always works in chunks of logits "
                        "(megarl.engines.megatron.heads); ignored", path, value, source)
        elif name == "policy_loss_mode" and value != "vanilla":
            errors.append(f"{path}={value}: megarl's OPD trains with the actor's policy loss")
        elif name not in ("policy_loss_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            errors.append(f"{path}: not a key of verl's distillation_loss config")
    if pool:
        nodes = pool.get("nnodes", (0, ""))[0]
        per_node = pool.get("n_gpus_per_node", (8, ""))[0]
        if nodes:
            problem = _add_pool(tree, origins, "distillation", nodes, per_node)
            if problem:
                errors.append(problem)
            else:
                _set(tree, "distillation.teacher.gpus", nodes * per_node, origins,
                     "verl keys distillation.nnodes x distillation.n_gpus_per_node")
    return errors


def _worker_env(tree: dict, grouped: dict, origins: dict) -> list[str]:
    """verl's `ray_kwargs.ray_init.runtime_env.env_vars.<NAME>` into trainer.worker_env.<NAME>."""
    prefix = "ray_kwargs.ray_init.runtime_env.env_vars."
    for name, (value, source) in _under(grouped, prefix).items():
        log.warning("%s%s (verl key, %s): its value goes to trainer.worker_env.%s", prefix, name, source, name)
        _set(tree, f"trainer.worker_env.{name}", value, origins, f"verl key {prefix}{name}")
    return []


def _radix_cache(tree: dict, grouped: dict, origins: dict) -> list[str]:
    """engine_kwargs.sglang.disable_radix_cache (SGLang's --disable-radix-cache) is megarl's
    actor_rollout_ref.rollout.enable_prefix_caching, negated; refused where both are given and differ."""
    path = "actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cache"
    if path not in grouped:
        return []
    value, source = grouped[path]
    if not isinstance(value, bool):
        return [f"{path}={value!r} ({source}): SGLang's --disable-radix-cache is a switch: true or false"]
    key = "actor_rollout_ref.rollout.enable_prefix_caching"
    if key in origins and _get(tree, key) == value:
        return [f"{path}={value} ({source}) contradicts {key}={_get(tree, key)} ({origins[key]})"]
    _set(tree, key, not value, origins, f"verl key {path}")
    log.warning("%s (verl key, %s): megarl names it %s=%s", path, source, key, not value)
    return []


_ROLLOUT = "actor_rollout_ref.rollout."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def verl_attention_dp_server(tp: int, dp: int) -> tuple[int, int]:
    """The SGLang server of verl's rollout tensor_model_parallel_size `tp` and data_parallel_size `dp`
    with expert parallelism: (its --tp-size, its --attn-dp-size) = (tp x dp, dp), megarl's
    (tensor_model_parallel_size, attention_data_parallel_size). verl's server takes tp x dp GPUs
    (async_sglang_server.py: tp_size = tensor_model_parallel_size x data_parallel_size); SGLang 0.5.23
    runs attention in dp groups of tp_size / attn_dp_size = tp ranks (runtime_context.py
    derive_attn_tp_size), which is verl's attention TP."""
    return tp * dp, dp


def _rollout_parallel(tree: dict, grouped: dict, origins: dict) -> list[str]:
    """verl's rollout data_parallel_size and moe_tensor_parallel_size, read with the rollout's
    tensor_model_parallel_size (tp) and expert_parallel_size (ep).

    data_parallel_size d: verl's SGLang server (verl/workers/rollout/sglang_rollout/async_sglang_server.py,
    its server args) gets tp_size = tp x d, dp_size = d, ep_size = ep, and verl asserts ep = tp x d when
    ep > 1 (verl/workers/config/rollout.py RolloutConfig.__post_init__). With ep = 1 it is d-way data
    parallelism, which megarl's servers of tp GPUs behind sglang-router already are (accepted, one warning).
    With ep > 1 and d > 1 one server spans tp x d GPUs, its experts over all of them and its attention
    data parallel in d groups of tp: SGLang 0.5.23's --tp-size tp x d --attn-dp-size d --ep-size ep (its
    own spelling of verl's `dp_size` with DP attention; arg_groups/parallel_hook.py
    handle_deprecated_dp_attention turns `--dp-size d --enable-dp-attention` into that). So
    tensor_model_parallel_size becomes tp x d (the server's GPUs, SGLang's --tp-size) and
    attention_data_parallel_size d (`verl_attention_dp_server`). That is what verl's vLLM server runs
    (vllm_rollout/vllm_async_server.py: data_parallel_size d of tp-GPU attention ranks with
    enable_expert_parallel); verl's SGLang arguments without `enable_dp_attention` would ask SGLang
    0.5.23 for d replicas of tp x d GPUs each (server_args.py compute_world_size: dp x tp), more than
    verl's replica of tp x d GPUs holds. megarl takes any ep the server's rule accepts (ep divides
    tp x d), not only verl's ep = tp x d. With `engine_kwargs.sglang.enable_dp_attention=true` verl's
    server is that one server whatever ep is (SGLang reads the flag beside dp_size d as --attn-dp-size d):
    the same mapping, the flag itself taken off the server's arguments.

    moe_tensor_parallel_size m: verl reads it for TensorRT-LLM only and asserts m = 1 otherwise
    ("moe_tensor_parallel_size is only supported for trtllm", RolloutConfig.__post_init__). SGLang derives
    the MoE TP size itself, moe_tp_size = tp_size / ep_size (derive_parallel_widths, moe_dp_size 1): m = 1
    or m equal to that is accepted with one warning (the servers run it), any other m refused."""
    rollout = tree["actor_rollout_ref"]["rollout"]
    tp, ep = rollout.get("tensor_model_parallel_size", 1), rollout.get("expert_parallel_size", 1)
    errors = []
    # engine_kwargs.sglang.enable_dp_attention: verl passes it to SGLang beside its dp_size = d, which SGLang
    # 0.5.23 reads as --attn-dp-size d (arg_groups/parallel_hook.py handle_deprecated_dp_attention; with d = 1
    # it adds nothing): megarl's attention_data_parallel_size, so the flag itself leaves the server's arguments
    sglang_kwargs = (rollout.get("engine_kwargs") or {}).get("sglang") or {}
    dp_attention = sglang_kwargs.get("enable_dp_attention") is True
    if dp_attention:
        del sglang_kwargs["enable_dp_attention"]
    if _ROLLOUT + "data_parallel_size" in grouped:
        d, source = grouped[_ROLLOUT + "data_parallel_size"]
        key = f"{_ROLLOUT}data_parallel_size={d} ({source})"
        attn_key = _ROLLOUT + "attention_data_parallel_size"
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            errors.append(f"{key}: must be a positive integer")
        elif d > 1 and _is_count(tp) and _is_count(ep) and (ep > 1 or dp_attention):
            server_tp, attn_dp = verl_attention_dp_server(tp, d)
            if attn_key in origins and _get(tree, attn_key) != attn_dp:
                errors.append(f"{key} with expert_parallel_size={ep} means {attn_key}={attn_dp}, which contradicts "
                              f"{attn_key}={_get(tree, attn_key)} ({origins[attn_key]})")
            else:
                _set(tree, _ROLLOUT + "tensor_model_parallel_size", server_tp, origins,
                     f"verl keys tensor_model_parallel_size={tp} x data_parallel_size={d} ({source})")
                _set(tree, attn_key, attn_dp, origins, f"verl key {_ROLLOUT}data_parallel_size={d} ({source})")
                log.warning("%sdata_parallel_size=%s (verl key, %s) with expert_parallel_size=%s%s: one SGLang server of "
                            "tensor_model_parallel_size x data_parallel_size = %s GPUs, its experts over all of them "
                            "and its attention data parallel in %s groups of %s GPUs (SGLang's --tp-size %s "
                            "--attn-dp-size %s --ep-size %s): megarl's tensor_model_parallel_size=%s and "
                            "attention_data_parallel_size=%s", _ROLLOUT, d, source, ep,
                            " and engine_kwargs.sglang.enable_dp_attention" if dp_attention else "", server_tp, attn_dp, tp,
                            server_tp, attn_dp, ep, server_tp, attn_dp)
                tp = server_tp
                dp_attention = False  # said by the mapping
        else:
            log.warning("%sdata_parallel_size=%s (verl key, %s): megarl runs one SGLang server per "
                        "tensor_model_parallel_size=%s GPUs behind sglang-router, which spreads the requests over them "
                        "(data parallelism over servers); ignored", _ROLLOUT, d, source, tp)
    if dp_attention:
        log.warning("%sengine_kwargs.sglang.enable_dp_attention=true without a rollout data_parallel_size above 1: "
                    "SGLang 0.5.23 reads it as --attn-dp-size = --dp-size = 1, which adds nothing; ignored", _ROLLOUT)
    if _ROLLOUT + "moe_tensor_parallel_size" in grouped:
        m, source = grouped[_ROLLOUT + "moe_tensor_parallel_size"]
        key = f"{_ROLLOUT}moe_tensor_parallel_size={m} ({source})"
        derived = tp // ep if isinstance(tp, int) and isinstance(ep, int) and ep >= 1 and tp % ep == 0 else None
        if m != 1 and m != derived:
            errors.append(f"{key}: verl reads it for TensorRT-LLM only and refuses it above 1 otherwise "
                          "(verl/workers/config/rollout.py: "
                          "\"moe_tensor_parallel_size is only supported for trtllm\"); "
                          f"SGLang derives the MoE TP size as tensor_model_parallel_size / expert_parallel_size = "
                          f"{tp}/{ep} (runtime_context.py derive_parallel_widths): set expert_parallel_size instead")
        else:
            log.warning("%smoe_tensor_parallel_size=%s (verl key, %s): SGLang derives the MoE TP size as "
                        "tensor_model_parallel_size / expert_parallel_size = %s/%s itself (--ep-size); ignored",
                        _ROLLOUT, m, source, tp, ep)
    return errors


# verl's MultiTurnConfig (verl/workers/config/rollout.py): read by its tool agent loop only
# (verl/experimental/agent_loop/tool_agent_loop.py ToolAgentLoop.__init__), which runs the samples whose
# data names agent_name=tool_agent; its tools come from tool_config_path / function_tool_path
_TOOL_LOOP = ("read by verl's tool agent loop only (verl/experimental/agent_loop/tool_agent_loop.py), which megarl "
              "does not have: megarl's agentic rollouts run the user's episode function "
              "(actor_rollout_ref.rollout.agent.path), which makes its own user and tool turns")
_MULTI_TURN_TOOLS = ("tool_config_path", "function_tool_path")
_MULTI_TURN = ("enable", "max_assistant_turns", *_MULTI_TURN_TOOLS, "max_user_turns", "max_parallel_calls",
               "max_tool_response_length", "tool_response_truncate_side", "use_inference_chat_template",
               "tokenization_sanity_check_mode", "format", "num_repeat_rollouts")


def _multi_turn(tree: dict, grouped: dict, origins: dict) -> list[str]:
    """verl's `actor_rollout_ref.rollout.multi_turn.*`: `enable` lets each sample's data pick its agent
    loop (verl/experimental/fully_async_policy/detach_utils.py: off, every sample runs single_turn_agent);
    `max_assistant_turns` is megarl's agent.max_turns (model calls per episode); the tool loop's tools
    (tool_config_path, function_tool_path) are refused: that loop is not built; the rest is accepted
    with one warning (`_TOOL_LOOP`)."""
    errors = []
    for name, (value, source) in _under(grouped, _ROLLOUT + "multi_turn.").items():
        key = f"{_ROLLOUT}multi_turn.{name}"
        if name not in _MULTI_TURN:
            errors.append(f"{key} ({source}): not a key of verl's multi_turn config ({', '.join(_MULTI_TURN)})")
        elif name in _MULTI_TURN_TOOLS and value is not None:
            errors.append(f"{key}={value} ({source}): verl's tool agent loop (tools from "
                          f"{' / '.join(_MULTI_TURN_TOOLS)}) is not built; megarl's agentic rollouts run the user's "
                          "episode function (actor_rollout_ref.rollout.agent.path), which calls its tools itself")
        elif name == "max_assistant_turns" and value is not None:
            _set(tree, _ROLLOUT + "agent.max_turns", value, origins, source)
            log.warning("%s=%s (verl key, %s): megarl names it actor_rollout_ref.rollout.agent.max_turns (model calls "
                        "per agent episode); its value goes there", key, value, source)
        elif name == "enable":
            log.warning("%s=%s (verl key, %s): verl then lets each sample's data choose its agent loop (agent_name); "
                        "megarl runs agent episodes where actor_rollout_ref.rollout.agent.path is set and single-turn "
                        "generation otherwise; ignored", key, value, source)
        else:
            log.warning("%s=%s (verl key, %s): %s; ignored", key, value, source, _TOOL_LOOP)
    return errors


def resolve_verl_groups(tree: dict, grouped: dict[str, tuple[Any, str]], origins: dict) -> list[str]:
    """Apply the grouped verl keys (path -> (value, where it came from)) to the raw config tree, in
    place; the problems found, one message each."""
    return [*_max_model_len(tree, grouped, origins), *_reward_kwargs(tree, grouped, origins),
            *_async(tree, grouped, origins), *_distillation(tree, grouped, origins),
            *_worker_env(tree, grouped, origins), *_radix_cache(tree, grouped, origins),
            *_rollout_parallel(tree, grouped, origins), *_multi_turn(tree, grouped, origins)]


# verl's entry points and megarl's (the same name under megarl), with the defaults verl's module brings
# (its Hydra config, verl/experimental/*/config/*_megatron_trainer.yaml), put before the user's overrides
# Both of verl's configs set algorithm.rollout_correction.bypass_mode=true (the rollout's log-probs are
# the old ones, no trainer pass; the fully async one adds use_rollout_log_probs=true, which megarl's
# bypass mode already means); a script's bypass_mode=false with rollout_is makes the trainer's pass.
FULLY_ASYNC_DEFAULTS = ("async_training.mode=fully_async", "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
                        "rollout.n_gpus_per_node=8", "async_training.partial_rollout=true",
                        "algorithm.rollout_correction.bypass_mode=true")
ONE_STEP_OFF_DEFAULTS = ("async_training.mode=one_step_off", "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1",
                         "rollout.n_gpus_per_node=8", "algorithm.rollout_correction.bypass_mode=true")
# verl's sft_trainer (sft_trainer_engine.yaml): its data are always chats (MultiTurnSFTDataset, messages_key
# `messages`); the estimator is unused by SFT, one without a critic keeps critic.* unchecked (as
# configs/tiny/sft.yaml). Its keys are read by megarl.config.verl_sft (load_config's verl_sft)
SFT_MODULE = "megarl.trainer.sft_trainer"
SFT_DEFAULTS = ("data.messages_key=messages", "algorithm.adv_estimator=reinforce_plus_plus")
# verl-recipe's DAPO entry point (recipe/dapo/main_dapo.py, its Hydra config dapo/config/dapo_trainer.yaml: verl's
# ppo_trainer with reward.reward_manager.name=dapo, filter_groups and the overlong buffer off, gen_batch_size =
# train_batch_size, which are megarl's defaults, and trainer.project_name=verl-dapo)
DAPO_MODULE = "megarl.recipe.dapo.main_dapo"
DAPO_DEFAULTS = ("reward_model.reward_manager=dapo", "trainer.project_name=verl-dapo")
VERL_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "verl.trainer.main_ppo": ("megarl.trainer.main_ppo", ()),
    "verl.experimental.fully_async_policy.fully_async_main": (FULLY_ASYNC_MODULE, FULLY_ASYNC_DEFAULTS),
    "verl.experimental.one_step_off_policy.main_ppo": (ONE_STEP_OFF_MODULE, ONE_STEP_OFF_DEFAULTS),
    "verl.trainer.sft_trainer": (SFT_MODULE, SFT_DEFAULTS),
    "recipe.dapo.main_dapo": (DAPO_MODULE, DAPO_DEFAULTS),
}
