"""`RolloutWorker`: the Ray actor of one rollout server. It starts the server process on its own
node and GPUs (megarl's CPU engine or real SGLang), reports whether it is alive, restarts it at
the same URL when told to (the fleet decides: a restarted server needs the current weights before
it may serve), and stops it.

Call `stop` before killing the actor: a killed actor leaves its server process running.
"""
from __future__ import annotations

import os
import socket
from typing import Optional

import ray

from megarl.net import free_port
from megarl.rollout.launch import apply_env_overrides, cpu_server_command, sglang_env_overrides, sglang_server_command
from megarl.rollout.process import ServerProcess, log_tail
from megarl.workers.base import RankedWorker


class RolloutWorker(RankedWorker):
    def __init__(self, rank: int, world_size: int, role: str, config, *, colocated: bool = False,
                 api_key: Optional[str] = None):
        super().__init__(rank, world_size, role)
        self.config, self.colocated, self.api_key = config, colocated, api_key
        self.process: Optional[ServerProcess] = None

    def start(self, model_path: str, bind_host: Optional[str] = None, startup_timeout_s: float = 600.0,
              log_path: Optional[str] = None) -> str:
        """Start the server and wait for health; returns its URL. `bind_host` None: this node's
        address (servers on other nodes must be reachable by the router)."""
        r = self.config.actor_rollout_ref.rollout
        host = bind_host or ray.util.get_node_ip_address()
        port = free_port(host)
        context = r.prompt_length + r.response_length
        if r.agent.path:  # an agent episode's later calls carry the whole trajectory so far
            context = max(context, r.agent.max_tokens_per_episode)
        if r.name == "cpu":
            command = cpu_server_command(model_path, port, host=host, api_key=self.api_key, dtype=r.dtype,
                                         context_length=context, max_running_requests=r.max_concurrent_requests,
                                         random_seed=self.config.trainer.seed + self.rank, num_threads=1)
            env = dict(os.environ)
        else:
            command = sglang_server_command(
                model_path, port, host=host, tp_size=r.tensor_model_parallel_size,
                base_gpu_id=int(ray.get_gpu_ids()[0]), mem_fraction_static=r.gpu_memory_utilization,
                enable_memory_saver=self.colocated, api_key=self.api_key, dtype=r.dtype, context_length=context,
                random_seed=self.config.trainer.seed + self.rank,
            )
            env = apply_env_overrides(os.environ, sglang_env_overrides(self.colocated))
        self.process = ServerProcess(f"rollout-{self.rank}", command, f"http://{host}:{port}", env=env,
                                     log_path=log_path, startup_timeout_s=startup_timeout_s)
        self.process.start()
        return self.process.url

    def status(self) -> dict:
        """Where the server is and whether it is alive (`exit_code`: negative = killed by that signal)."""
        p = self.process
        return {"url": p.url, "pid": p.pid, "running": p.is_running(), "exit_code": p.returncode,
                "restarts": p.restarts, "log_path": p.log_path, "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname()}

    def restart(self) -> str:
        """Start the server again at its URL if it exited; returns the URL. Raises
        `ServerStartError` (quoting its log) if it does not come back healthy."""
        self.process.ensure_running()
        return self.process.url

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.process.log_path, lines)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
