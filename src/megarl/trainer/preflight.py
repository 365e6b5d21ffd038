"""Checks of the machine against a validated config, before any worker starts.

Static checks live in megarl.config.validate (they pass on any machine, so a config can be
validated on a laptop); these look at files and devices, and name the key to fix.
"""
from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Optional

from megarl.config import ConfigError, ExperimentConfig
from megarl.config.rules.qat import quantization_config_problems
from megarl.config.validate import problems_on_resolved_device
from megarl.runtime.devices import resolve_devices
from megarl.runtime.routing import routed_experts_layout
from megarl.trainer.inputs import (
    Kind,
    data_problems,
    gpu_count_problem,
    model_inputs,
    mtp_model_problem,
    moe_tensor_parallel_problem,
    optimizer_override_problems,
    rollout_expert_split_problem,
    sglang_cpu_model_problem,
    sglang_tied_head_problem,
    schedule_problems,
    transformer_override_problems,
)


DRY_RUN_HELP = ("validate the config and check data, model, tokenizer, schedule and GPUs as the run would, "
                "then stop before Ray starts")
DRY_RUN_OK = "dry run OK: config, data, model and machine checked (stopping before Ray starts)"


def with_source_files(config: ExperimentConfig) -> ExperimentConfig:
    """The config with data.source's files (written now when not yet there) as train_files and val_files;
    unchanged without a source. ConfigError (the task unknown, with close names; the library missing) first."""
    if config.data.source is None:
        return config
    from megarl.data.reasoning_gym import write_source

    paths = write_source(config.data, config.trainer.default_local_dir)
    return replace(config, data=replace(config.data, train_files=[str(paths["train"])], val_files=[str(paths["val"])]))


def check_environment(config: ExperimentConfig, kind: Kind = "rl") -> ExperimentConfig:
    """Check data, model, tokenizer, schedule and devices for trainer `kind` ("rl", "sft", "dpo");
    return the config with hub ids replaced by their HF-cache directories. Raises ConfigError
    listing every problem. Runs in seconds, before Ray or any server starts (--dry-run runs it too)."""
    config = with_source_files(config)
    problems, train_rows = data_problems(config, kind)
    problems += schedule_problems(config, kind, train_rows)
    problems += transformer_override_problems(config)
    problems += optimizer_override_problems(config)
    model_problems, config = model_inputs(config)
    problems += model_problems
    if not model_problems:
        problems += [p for p in [moe_tensor_parallel_problem(config), mtp_model_problem(config)] if p]
    if kind == "rl" and not model_problems:
        problems += [p for p in [rollout_expert_split_problem(config)] if p]
        try:
            routed_experts_layout(config)
        except ConfigError as problem:
            problems.append(str(problem))
    rm = config.reward_model
    if kind == "rl" and rm.enable and rm.model.path and not model_problems:
        from megarl.engines.megatron.reward_model import check_tokenizer

        try:
            check_tokenizer(config)
        except NotImplementedError as error:
            problems.append(str(error))
    if kind == "rl" and config.distillation.enabled and not model_problems:
        from megarl.trainer.teacher import check_same_tokenizer, student_tokenizer_path

        try:
            check_same_tokenizer(student_tokenizer_path(config), config.distillation.teacher.model_path)
        except (ConfigError, OSError, ValueError) as problem:
            problems.append(str(problem))
    reward_fn = config.custom_reward_function.path
    if kind == "rl" and reward_fn and not Path(reward_fn).is_file():
        problems.append(f"custom_reward_function.path: file not found: {reward_fn}")
    problems += quantization_config_problems(config)

    try:
        devices = resolve_devices(config)
    except ConfigError as problem:
        problems.append(str(problem))
        devices = None
    import torch

    cuda = devices is not None and devices.device == "cuda"
    if devices is not None:
        problems += problems_on_resolved_device(config, devices.device, steps_from_data=kind == "sft")
    problems += [p for p in [gpu_count_problem(config, cuda, torch.cuda.device_count() if cuda else 0)] if p]
    if kind == "rl" and config.actor_rollout_ref.rollout.name == "sglang":
        problem = sglang_install_problem(config.actor_rollout_ref.rollout.server_python, cuda)
        if problem and not cuda and config.trainer.device == "auto":
            problem += "; this machine has no CUDA GPU, so trainer.device=auto runs the experiment on the CPU"
        problems += [problem] if problem else []
        if not model_problems:
            problems += [p for p in [sglang_tied_head_problem(config)] if p]
        if not cuda and not model_problems:
            problems += [p for p in [sglang_cpu_model_problem(config)] if p]
        if config.actor_rollout_ref.rollout.engine_kwargs.get("sglang") and devices is not None:
            problems += [p for p in [engine_kwargs_problem(config, devices.device)] if p]
    if problems:
        raise ConfigError("this machine cannot run the experiment:\n" + "\n".join(f"  - {p}" for p in problems))
    return config


def engine_kwargs_problem(config: ExperimentConfig, device: str) -> Optional[str]:
    """Where engine_kwargs.sglang contradicts the flags megarl gives its SGLang servers on `device`
    (megarl.rollout.launch.sglang_command, as the rollout workers build it), the problem; else None."""
    from megarl.rollout.launch import sglang_command

    r = config.actor_rollout_ref.rollout
    try:
        sglang_command(config, config.actor_rollout_ref.model.path, 0, device=device,
                       colocated=config.placement.mode == "colocate",
                       context_length=r.prompt_length + r.response_length)
    except ValueError as problem:
        return str(problem)
    return None


def sglang_install_problem(server_python: Optional[str], on_cuda: bool) -> Optional[str]:
    """Why the SGLang servers could not start here, or None: `server_python`
    (actor_rollout_ref.rollout.server_python; None: this interpreter) must import sglang. On a CPU,
    SGLang comes from its own venv (`make install-sglang`, docs/sglang-on-cpu.md)."""
    key = "actor_rollout_ref.rollout.name=sglang"
    how = ("pip install -e .[gpu]" if on_cuda else
           "make install-sglang, then actor_rollout_ref.rollout.server_python=.venv-sglang/bin/python "
           "(docs/sglang-on-cpu.md); or actor_rollout_ref.rollout.name=cpu, megarl's CPU engine")
    if server_python is None:
        return None if importlib.util.find_spec("sglang") else f"{key}: sglang is not installed here ({how})"
    try:
        found = subprocess.run([server_python, "-c", "import importlib.util, sys; "
                                "sys.exit(importlib.util.find_spec('sglang') is None)"],
                               capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"actor_rollout_ref.rollout.server_python={server_python}: cannot run it ({e})"
    return None if found else f"actor_rollout_ref.rollout.server_python={server_python} has no sglang ({how})"
