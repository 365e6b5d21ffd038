"""Command lines (and environments) that start rollout servers and the router. Pure functions.

* megarl's CPU engine: `python -m megarl.rollout.cpu_server ...`
* real SGLang (GPU, the `[gpu]` extra, 0.5.23): `python -m sglang.launch_server ...`
* the router (PyPI `sglang-router`, a Rust binary in a Python wheel; runs on CPU):
  `python -m sglang_router.launch_router --worker-urls ...`
"""
from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Optional


def cpu_server_command(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    api_key: Optional[str] = None,
    dtype: str = "auto",
    context_length: Optional[int] = None,
    max_running_requests: int = 64,
    random_seed: int = 0,
    num_threads: Optional[int] = None,
    python: str = sys.executable,
) -> list[str]:
    cmd = [python, "-m", "megarl.rollout.cpu_server", "--model-path", model_path, "--host", host, "--port", str(port)]
    cmd += ["--dtype", dtype, "--max-running-requests", str(max_running_requests), "--random-seed", str(random_seed)]
    if api_key:
        cmd += ["--api-key", api_key]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    if num_threads:
        cmd += ["--num-threads", str(num_threads)]
    return cmd


def sglang_server_command(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    base_gpu_id: int = 0,
    mem_fraction_static: Optional[float] = None,
    enable_memory_saver: bool = False,
    api_key: Optional[str] = None,
    dtype: str = "auto",
    context_length: Optional[int] = None,
    random_seed: Optional[int] = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """`enable_memory_saver` when colocated with training (release/resume memory between phases);
    `base_gpu_id` is the first of the `tp_size` visible GPUs this server takes (from the placement)."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host, "--port", str(port)]
    cmd += ["--tp-size", str(tp_size), "--base-gpu-id", str(base_gpu_id), "--dtype", dtype, "--skip-server-warmup"]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if enable_memory_saver:
        cmd += ["--enable-memory-saver"]
    if api_key:
        cmd += ["--api-key", api_key]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    if random_seed is not None:
        cmd += ["--random-seed", str(random_seed)]
    return cmd + list(extra_args)


def sglang_env_overrides(enable_memory_saver: bool) -> dict[str, Optional[str]]:
    """Environment changes for a real SGLang server (None = unset): `/health` answers without running
    a generation (the router polls it), and expandable CUDA segments are off under the memory saver
    (they break it)."""
    overrides: dict[str, Optional[str]] = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
    if enable_memory_saver:
        overrides["PYTORCH_CUDA_ALLOC_CONF"] = None
    return overrides


def apply_env_overrides(base_env: Mapping[str, str], overrides: Mapping[str, Optional[str]]) -> dict[str, str]:
    env = dict(base_env)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def router_command(
    worker_urls: Sequence[str],
    port: int,
    *,
    prometheus_port: int,
    host: str = "127.0.0.1",
    policy: str = "round_robin",
    api_key: Optional[str] = None,
    disable_retries: bool = False,
    health_check_interval_s: int = 5,
    request_timeout_s: int = 3600,
    log_level: str = "warn",
    python: str = sys.executable,
) -> list[str]:
    """Every router needs its own `prometheus_port` (a second one on the default port panics at start).
    `api_key` is what the router sends to workers. `disable_retries` leaves retrying to the client."""
    cmd = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port), "--policy", policy]
    cmd += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port), "--log-level", log_level]
    cmd += ["--health-check-interval-secs", str(health_check_interval_s)]
    cmd += ["--request-timeout-secs", str(request_timeout_s)]
    if worker_urls:
        cmd += ["--worker-urls", *worker_urls]
    if api_key:
        cmd += ["--api-key", api_key]
    if disable_retries:
        cmd += ["--disable-retries"]
    return cmd
