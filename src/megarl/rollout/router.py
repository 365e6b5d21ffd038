"""The real `sglang-router` (PyPI, a Rust binary; runs on CPU) in front of N rollout servers.

It proxies `/generate` to its workers (round robin by default), health-checks them through
`/health`, and takes workers in and out at run time: `POST /workers {"url", "worker_type"}`,
`DELETE /workers/{id}`, `GET /workers`. Registration is asynchronous (HTTP 202), so `add_worker`
and `remove_worker` wait until the worker list shows the change. The router process renames itself
`sglang::router`; it is tracked and stopped by PID, never by name. With `api_key`, the router
demands `Authorization: Bearer KEY` from its clients and sends the same key to its workers.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional

import requests

from megarl.rollout.control import ServerError
from megarl.rollout.launch import router_command
from megarl.rollout.process import ServerProcess


class Router:
    def __init__(
        self,
        worker_urls: Sequence[str],
        port: int,
        *,
        prometheus_port: int,
        host: str = "127.0.0.1",
        policy: str = "round_robin",
        api_key: Optional[str] = None,
        disable_retries: bool = False,
        health_check_interval_s: int = 5,
        log_path: Optional[str] = None,
        startup_timeout_s: float = 60.0,
        ready_timeout_s: float = 60.0,
    ):
        """`startup_timeout_s`: for the process to answer; `ready_timeout_s`: then for every
        initial worker to be registered and healthy (`start`)."""
        self.name = "sglang-router"
        self.url = f"http://{host}:{port}"
        self.ready_timeout_s = ready_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.initial_workers = [u.rstrip("/") for u in worker_urls]
        command = router_command(
            self.initial_workers,
            port,
            prometheus_port=prometheus_port,
            host=host,
            policy=policy,
            api_key=api_key,
            disable_retries=disable_retries,
            health_check_interval_s=health_check_interval_s,
        )
        self.process = ServerProcess(
            self.name, command, self.url, log_path=log_path, startup_timeout_s=startup_timeout_s
        )

    def start(self, timeout_s: Optional[float] = None) -> None:
        """Start the router and wait until every initial worker is registered and healthy (for
        `timeout_s` seconds; None: `ready_timeout_s`). Raises `ServerStartError` (`port_taken` when
        another process bound one of its ports first: `process.start_on_a_free_port` starts again)."""
        self.process.start()
        try:
            self._wait_for(lambda urls: set(self.initial_workers) <= urls,
                           self.ready_timeout_s if timeout_s is None else timeout_s, "all initial workers healthy")
        except BaseException:  # nobody holds a router that did not start: stopped here
            self.process.stop()
            raise

    def stop(self, timeout_s: float = 15.0) -> None:
        self.process.stop(timeout_s)

    def workers(self) -> list[dict]:
        """The router's view: dicts with `id`, `url`, `is_healthy`, `load`, `metadata`, ..."""
        resp = requests.get(self.url + "/workers", headers=self._headers, timeout=10)
        resp.raise_for_status()
        return resp.json()["workers"]

    def worker_urls(self, healthy_only: bool = False) -> list[str]:
        return [w["url"] for w in self.workers() if w["is_healthy"] or not healthy_only]

    def add_worker(self, url: str, timeout_s: float = 60.0) -> None:
        url = url.rstrip("/")
        resp = requests.post(
            self.url + "/workers", json={"url": url, "worker_type": "regular"}, headers=self._headers, timeout=10
        )
        if resp.status_code >= 400:
            raise ServerError(f"router: adding worker {url} failed: HTTP {resp.status_code}: {resp.text}")
        self._wait_for(lambda urls: url in urls, timeout_s, f"worker {url} registered and healthy")

    def remove_worker(self, url: str, timeout_s: float = 60.0) -> None:
        url = url.rstrip("/")
        ids = [w["id"] for w in self.workers() if w["url"] == url]
        if not ids:
            raise ServerError(f"router: no worker {url} to remove")
        for worker_id in ids:
            resp = requests.delete(f"{self.url}/workers/{worker_id}", headers=self._headers, timeout=10)
            if resp.status_code >= 400:
                raise ServerError(f"router: removing worker {url} failed: HTTP {resp.status_code}: {resp.text}")
        self._wait_for(lambda urls: url not in set(self.worker_urls()), timeout_s, f"worker {url} removed")

    def _wait_for(self, done, timeout_s: float, what: str) -> None:
        """Poll the healthy worker URLs until `done(urls)`; `ServerError` on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if done(set(self.worker_urls(healthy_only=True))):
                return
            time.sleep(0.2)
        raise ServerError(f"router {self.url}: timed out after {timeout_s:.0f} s waiting for {what}")
