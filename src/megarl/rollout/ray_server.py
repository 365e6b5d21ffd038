"""`RolloutServer`: a Ray actor that owns one rollout server process on its node.

A thin wrapper over `ServerProcess` + `ProcessMonitor`: it starts the command (real SGLang or the
CPU engine, from `megarl.rollout.launch`), waits for health, restarts the process if it crashes,
and stops it. Placement (which node, which GPUs, `--base-gpu-id`) is decided by the caller, e.g.

    server = RolloutServer.options(num_cpus=0, num_gpus=1, scheduling_strategy=...).remote(cmd, url)
    ray.get(server.start.remote())

Call `stop` before killing the actor: a killed actor leaves its server process running.
"""
from __future__ import annotations

import os
from typing import Optional

import ray

from megarl.rollout.launch import apply_env_overrides
from megarl.rollout.process import ProcessMonitor, ServerProcess


@ray.remote
class RolloutServer:
    def __init__(
        self,
        command: list[str],
        url: str,
        *,
        env_overrides: Optional[dict[str, Optional[str]]] = None,
        health_path: str = "/health",
        startup_timeout_s: float = 600.0,
        monitor_interval_s: float = 2.0,
        log_path: Optional[str] = None,
    ):
        """`env_overrides` apply to the actor's own environment (None unsets), which holds what Ray
        set for it, such as CUDA_VISIBLE_DEVICES."""
        self.process = ServerProcess(
            "rollout-server",
            command,
            url,
            health_path=health_path,
            env=apply_env_overrides(os.environ, env_overrides or {}),
            log_path=log_path,
            startup_timeout_s=startup_timeout_s,
        )
        self.monitor = ProcessMonitor([self.process], interval_s=monitor_interval_s)

    def start(self) -> str:
        """Start the server, wait for health, begin watching it; returns its URL."""
        self.process.start()
        self.monitor.start()
        return self.process.url

    def status(self) -> dict:
        return {
            "url": self.process.url,
            "pid": self.process.pid,
            "running": self.process.is_running(),
            "restarts": self.process.restarts,
            "log_path": self.process.log_path,
        }

    def stop(self) -> None:
        self.monitor.stop()
        self.process.stop()
