"""`RolloutWorker`: the Ray actor of one rollout server. It starts the server process on its own
node and GPUs (megarl's CPU engine or real SGLang), reports whether it is alive (and, asked, whether
it answers `/health`), kills it when the fleet finds it hung, restarts it at
the same URL when told to (the fleet decides: a restarted server needs the current weights before
it may serve), and stops it. A SGLang server larger than a node has one actor per node: the one of
node rank 0 serves HTTP, the others run their share of the TP ranks (`MultiNode`).

Call `stop` before killing the actor: a killed actor leaves its server process running.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Optional

import ray

from megarl.config.devices import visible_gpu_index
from megarl.config.rules.router_replay import replays_routes
from megarl.net import free_port
from megarl.rollout.control import ServerControl
from megarl.rollout.launch import (
    MultiNode,
    cpu_server_command,
    lora_serving,
    sglang_command,
    sglang_server_env,
    uses_memory_saver,
)
from megarl.rollout.process import ServerProcess, log_tail, start_on_a_free_port
from megarl.workers.base import RankedWorker


class RolloutWorker(RankedWorker):
    def __init__(self, rank: int, world_size: int, role: str, config, *, colocated: bool = False,
                 api_key: Optional[str] = None, device: str = "cuda"):
        """`device`: the run's device (cuda or cpu, `megarl.config.devices`); real SGLang serves on it."""
        super().__init__(rank, world_size, role)
        self.config, self.colocated, self.api_key, self.device = config, colocated, api_key, device
        self.process: Optional[ServerProcess] = None
        self.multi_node: Optional[MultiNode] = None

    def dist_init_address(self) -> str:
        """Node rank 0 of a multi-node server: "host:port" where its nodes meet (SGLang's
        `--dist-init-addr`), on this node's address and a port free now."""
        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def start(self, model_path: str, bind_host: Optional[str] = None, startup_timeout_s: float = 600.0,
              log_path: Optional[str] = None, multi_node: Optional[MultiNode] = None,
              server: Optional[int] = None) -> str:
        """Start the server and wait for health; returns its URL. `bind_host` None: this node's
        address (servers on other nodes must be reachable by the router). `multi_node`: this
        actor's node of a server spanning nodes; node ranks >= 1 serve no HTTP, so they return as
        soon as their process started (node 0's health means every node joined). `server`: the server's
        index (its random seed; default this actor's rank), the same on every node of it."""
        server = self.rank if server is None else server
        r = self.config.actor_rollout_ref.rollout
        host = bind_host or ray.util.get_node_ip_address()
        context = r.prompt_length + r.response_length
        if r.agent.path:  # an agent episode's later calls carry the whole trajectory so far
            context = max(context, r.agent.max_tokens_per_episode)
        self.multi_node = multi_node
        serves_http = multi_node is None or multi_node.node_rank == 0
        name = f"rollout-{server}" + (f"-node{multi_node.node_rank}" if multi_node else "")

        def server_on(port: int) -> ServerProcess:
            if r.name == "cpu":
                command = cpu_server_command(model_path, port, host=host, api_key=self.api_key, dtype=r.dtype,
                                             context_length=context, max_running_requests=r.max_concurrent_requests,
                                             random_seed=self.config.trainer.seed + server, num_threads=1,
                                             lora=lora_serving(self.config),
                                             return_routed_experts=replays_routes(self.config),
                                             ep_size=r.expert_parallel_size, prefix_caching=r.enable_prefix_caching,
                                             # a step's prompts come in one request per server: no burst to wait for
                                             batch_wait_ms=0 if r.batch_requests_per_server else None)
                env = dict(os.environ)
            else:
                # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 (the fleet sets it): this process sees the
                # raylet's GPUs, and --base-gpu-id indexes them
                on_gpu = self.device == "cuda"
                base_gpu = visible_gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")) if on_gpu else 0
                command = sglang_command(self.config, model_path, port, device=self.device, colocated=self.colocated,
                                         context_length=context, host=host, base_gpu_id=base_gpu, api_key=self.api_key,
                                         multi_node=multi_node, server=server)
                env = sglang_server_env(os.environ, device=self.device,
                                        enable_memory_saver=uses_memory_saver(self.device, self.colocated),
                                        colocated=self.colocated)
            return ServerProcess(name, command, f"http://{host}:{port}", env=env,
                                 health_path="/health" if serves_http else None,
                                 log_path=log_path, startup_timeout_s=startup_timeout_s)

        self.process = start_on_a_free_port(server_on, host)
        return self.process.url

    def status(self, health_timeout_s: Optional[float] = None) -> dict:
        """Where the server is and whether it is alive (`exit_code`: negative = killed by that signal).
        With `health_timeout_s` (seconds), a running server that serves HTTP is also asked `/health`
        from here, its own node: `answers` is whether HTTP 200 came within that bound, `probe_s` how
        long the probe took (seconds); both None when not probed (not asked, not running, or node
        >= 1 of a multi-node server, which serves no HTTP)."""
        p = self.process
        running = p.is_running()
        answers = probe_s = None
        if health_timeout_s is not None and running and p.health_path is not None:
            started = time.monotonic()
            answers = ServerControl(p.url).health(timeout_s=health_timeout_s)
            probe_s = time.monotonic() - started
        return {"url": p.url, "pid": p.pid, "running": running, "exit_code": p.returncode,
                "restarts": p.restarts, "log_path": p.log_path, "ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "answers": answers, "probe_s": probe_s}

    def kill(self, reason: str) -> None:
        """SIGKILL the server's process group and reap it: a server that is alive but stopped
        answering (`ServerProcess.kill`). The fleet then calls `restart`, as for one that died."""
        self.process.kill(reason)

    def restart(self) -> str:
        """Start the server again at its URL if it exited; returns the URL. Raises
        `ServerStartError` (quoting its log) if it does not come back healthy. A node of a
        multi-node server restarts even if it still runs: the fleet restarts all nodes of a
        server together."""
        if self.multi_node is not None:
            self.process.restart()
        else:
            self.process.ensure_running()
        return self.process.url

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.process.log_path, lines)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
