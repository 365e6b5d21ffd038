"""The controller's handle on generation: rollout servers (one Ray actor each, placed by the plan)
behind the real sglang-router, and the client that drives them."""
from __future__ import annotations

import socket
from typing import Optional

from megarl.placement.planner import RolePlacement
from megarl.placement.ray_pools import RealisedPools
from megarl.placement.worker_group import WorkerGroup
from megarl.rollout.client import RolloutClient, RolloutResult
from megarl.rollout.control import ServerControl
from megarl.rollout.protocol import SamplingParams
from megarl.rollout.router import Router
from megarl.workers.rollout_worker import RolloutWorker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RolloutFleet:
    def __init__(self, role: RolePlacement, pools: RealisedPools, config, *, colocated: bool,
                 single_node: bool, api_key: Optional[str] = None, startup_timeout_s: float = 600.0):
        r = config.actor_rollout_ref.rollout
        self.api_key = api_key
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if r.name == "sglang" else {}
        self.workers = WorkerGroup(RolloutWorker, role, pools, config, colocated=colocated, api_key=api_key, env=env)
        self.router: Optional[Router] = None
        try:
            bind = "127.0.0.1" if single_node else None
            self.urls = self.workers.call("start", config.actor_rollout_ref.model.path, bind,
                                          startup_timeout_s, timeout_s=startup_timeout_s + 60)
            # The router runs on the driver's node and listens on loopback: only this client calls it.
            self.router = Router(self.urls, _free_port(), prometheus_port=_free_port(), api_key=api_key)
            self.router.start(timeout_s=120)
        except BaseException:
            self.shutdown()
            raise
        self.client = RolloutClient(self.router.url, api_key=api_key, abort_urls=self.urls,
                                    max_concurrency=r.max_concurrent_requests, request_timeout_s=r.request_timeout_s)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 seeds: Optional[list[int]] = None) -> RolloutResult:
        """`seeds`: per-prompt sampling seeds (see RolloutClient.agenerate)."""
        return self.client.generate(prompts, sampling, seeds=seeds)

    def servers(self) -> list[ServerControl]:
        return [ServerControl(url, self.api_key) for url in self.urls]

    def release_memory(self) -> None:
        """Colocated: free the servers' weights and KV cache while training runs (the weight push
        resumes them)."""
        for server in self.servers():
            server.release_memory_occupation()

    def shutdown(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.workers.actors:
            try:
                self.workers.call("stop", timeout_s=60)
            finally:
                self.workers.shutdown()
