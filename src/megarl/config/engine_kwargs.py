"""verl's `actor_rollout_ref.rollout.engine_kwargs.<engine>.<arg>`: extra arguments of the rollout servers.

verl hands `engine_kwargs.sglang` to SGLang's ServerArgs; megarl serves with SGLang and puts each one
on the command line of the SGLang servers it launches (megarl.rollout.launch.sglang_server_command),
as SGLang's own `--config` file would (sglang/srt/utils/server_args_config_parser.py
`_convert_config_to_args`: a true switch adds the flag, a false one nothing; a list gives the flag
and its items; a dict its JSON). Each key must be a command-line server argument of SGLang 0.5.23
(megarl.config.sglang_server_args, generated from SGLang's own parser). Refused, naming the key:
any other key (SGLang refuses it too), an argument megarl sets from its own keys (OWNED) unless it
is the value megarl passes, and anything for megarl's CPU engine (it is not SGLang).
`engine_kwargs.vllm` / `trtllm` are read by verl's vLLM / TensorRT-LLM servers only, and verl
ignores them when it serves with SGLang (its SGLang server reads `engine_kwargs.sglang`:
verl/workers/rollout/sglang_rollout/async_sglang_server.py); megarl serves with SGLang, so it
ignores them too, with one warning each (`other_engines_kwargs`).
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from megarl.config.sglang_server_args import SERVER_ARGS, SGLANG_VERSION

ENGINES = ("sglang", "vllm", "trtllm")
_PLACED = "megarl places each server (its address, GPUs and nodes)"
# SGLang's arguments that megarl's launch command sets from megarl's own keys: dest -> what owns it
OWNED = {
    "model_path": "actor_rollout_ref.model.path",
    "host": _PLACED, "port": _PLACED, "base_gpu_id": _PLACED, "nnodes": _PLACED, "node_rank": _PLACED,
    "dist_init_addr": _PLACED,
    "tp_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "ep_size": "actor_rollout_ref.rollout.expert_parallel_size",
    "attn_dp_size": "actor_rollout_ref.rollout.attention_data_parallel_size",
    "dp_size": "megarl's servers behind sglang-router (verl's actor_rollout_ref.rollout.data_parallel_size)",
    "dtype": "actor_rollout_ref.rollout.dtype",
    "quantization": "actor_rollout_ref.rollout.quantization",
    "mem_fraction_static": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "max_running_requests": "actor_rollout_ref.rollout.max_concurrent_requests",
    "context_length": "actor_rollout_ref.rollout.prompt_length + response_length",
    "api_key": "actor_rollout_ref.rollout.api_key_env",
    "random_seed": "trainer.seed",
    "device": "trainer.device",
    "skip_server_warmup": "megarl (its servers skip the warm-up request)",
    "enable_deterministic_inference": "actor_rollout_ref.rollout.deterministic_inference",
    "enable_return_routed_experts": "actor_rollout_ref.actor.router_replay.mode",
    "enable_lora": "actor_rollout_ref.model.lora.*", "max_lora_rank": "actor_rollout_ref.model.lora.*",
    "lora_target_modules": "actor_rollout_ref.model.lora.*",
    "disable_radix_cache": "actor_rollout_ref.rollout.enable_prefix_caching",
    "enable_memory_saver": "megarl (on where a server shares its GPUs with training: placement.mode=colocate)",
    "enable_weights_cpu_backup": "megarl (with the memory saver and actor_rollout_ref.model.lora.sync=adapter)",
}
_CPU_ENGINE = ("megarl's CPU engine (actor_rollout_ref.rollout.name=cpu) is not SGLang and takes no SGLang server "
               "arguments; real SGLang (rollout.name=sglang) does")


def engine_kwargs_problems(engine_kwargs: Mapping[str, Any], rollout_name: str) -> list[str]:
    """What megarl refuses in `engine_kwargs` ({engine: {arg: value}}) before any server starts
    (the arguments megarl also sets are checked against its command: `sglang_engine_flags`)."""
    key = "actor_rollout_ref.rollout.engine_kwargs"
    problems = []
    for engine, kwargs in engine_kwargs.items():
        if engine not in ENGINES:
            problems.append(f"{key}.{engine}: not an engine of verl's engine_kwargs ({', '.join(ENGINES)})")
        elif not isinstance(kwargs, Mapping):
            problems.append(f"{key}.{engine}={kwargs!r}: a mapping of server arguments")
        elif engine == "sglang":
            for arg, value in kwargs.items():
                problem = _arg_problem(arg, value) or (_CPU_ENGINE if rollout_name == "cpu" else None)
                problem = problem or (f"megarl sets it from {OWNED[arg]}" if arg in OWNED and not _is_off(arg, value)
                                      else None)
                if problem:
                    problems.append(f"{key}.sglang.{arg}={value!r}: {problem}")
    return problems


def deprecated_sglang_kwargs(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """Warnings, one per deprecated SGLang switch set in `engine_kwargs.sglang`: SGLang 0.5.23 still reads
    it (`--disable-cuda-graph`: arg_groups/cuda_graph_hook.py, both phases' backend disabled;
    `--enable-dp-attention`: arg_groups/parallel_hook.py handle_deprecated_dp_attention, --attn-dp-size =
    --dp-size), so megarl passes it on as verl does."""
    kwargs = engine_kwargs.get("sglang")
    if not isinstance(kwargs, Mapping):
        return []
    return [f"actor_rollout_ref.rollout.engine_kwargs.sglang.{arg}={value!r}: deprecated in SGLang {SGLANG_VERSION}, "
            f"which still reads it (its new spelling: {SERVER_ARGS[arg][1].partition(': ')[2]}); passed on"
            for arg, value in kwargs.items()
            if arg in SERVER_ARGS and SERVER_ARGS[arg][1].startswith("deprecated") and value is True]


def other_engines_kwargs(engine_kwargs: Mapping[str, Any]) -> list[str]:
    """Warnings, one per `engine_kwargs.vllm` / `trtllm` argument: megarl serves with SGLang and
    ignores them, as verl does when its rollout is SGLang."""
    key = "actor_rollout_ref.rollout.engine_kwargs"
    return [f"{key}.{engine}.{arg}={value!r} is read by verl's {engine} server only; megarl serves with SGLang "
            f"(its server arguments: {key}.sglang.*), so it is ignored, as verl ignores it with rollout.name=sglang"
            for engine, kwargs in engine_kwargs.items() if engine in ("vllm", "trtllm") and isinstance(kwargs, Mapping)
            for arg, value in kwargs.items()]


def _is_off(arg: str, value: Any) -> bool:
    """A false switch: SGLang's own default, which adds nothing to the command."""
    return SERVER_ARGS[arg][1] == "switch" and value is False


def _arg_problem(arg: str, value: Any) -> str | None:
    """Why `arg=value` is not a server argument SGLang's command line takes, or None."""
    if arg not in SERVER_ARGS:
        return f"not a command-line server argument of SGLang {SGLANG_VERSION}"
    kind = SERVER_ARGS[arg][1]
    if (kind in ("switch", "bool") or kind.startswith("deprecated")) and not isinstance(value, bool):
        return f"SGLang's {SERVER_ARGS[arg][0]} is a switch: true or false"
    if kind == "value" and isinstance(value, list):
        return f"SGLang's {SERVER_ARGS[arg][0]} takes one value"
    if kind == "values" and not isinstance(value, list):
        return f"SGLang's {SERVER_ARGS[arg][0]} takes a list"
    return None


def _flags(arg: str, value: Any) -> list[str]:
    """`arg=value` on SGLang's command line (server_args_config_parser.py `_convert_config_to_args`;
    a --flag / --no-flag switch: the one the value picks)."""
    flag, kind = SERVER_ARGS[arg]
    if kind == "bool":
        return [flag if value else "--no-" + flag[2:]]
    if kind == "switch" or kind.startswith("deprecated"):
        return [flag] if value else []
    if kind == "values":
        return [flag, *map(str, value)] if value else []
    if value is None:
        return []  # SGLang's default
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value).lower() if isinstance(value, bool)
            else str(value)]


def sglang_engine_flags(kwargs: Mapping[str, Any], command: list[str]) -> list[str]:
    """The flags that put `kwargs` (engine_kwargs.sglang) on SGLang's `command` (megarl's own, for
    this server). ValueError naming each problem: `engine_kwargs_problems`'s, and an argument the
    command already sets to another value (megarl's CPU flags for SGLang on a CPU, the memory
    saver where a server shares its GPUs, ...). One the command sets to the same value adds nothing."""
    problems = engine_kwargs_problems({"sglang": dict(kwargs)}, "sglang")
    if problems:
        raise ValueError("; ".join(problems))
    out = []
    for arg, value in kwargs.items():
        flag = SERVER_ARGS[arg][0]
        wanted = _flags(arg, value)
        if flag in command or arg in OWNED:
            index = command.index(flag) if flag in command else None
            kind = SERVER_ARGS[arg][1]
            given = [] if index is None else [flag] if kind == "switch" else command[index:index + 2]
            if wanted != given:
                owner = OWNED.get(arg, "megarl's own flags for this server (megarl.rollout.launch)")
                raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.sglang.{arg}={value!r}: megarl's command "
                                 f"for this server has {' '.join(given) or f'no {flag}'}, set by {owner}")
            continue
        out += wanted
    return out
