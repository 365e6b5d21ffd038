"""Admin calls to one SGLang-protocol server: health, info, cache, abort, memory and weight updates.

Works against real SGLang 0.5.23 and megarl's CPU engine alike. Every call either succeeds or raises
`ServerError` naming the URL, the endpoint, the HTTP status and the server's message. Weight updates
from tensors or the distributed group must sit inside `begin_weight_update()` ... `end_weight_update()`
(SGLang 0.5.23 refuses them otherwise); `update_weights_from_disk` needs no session.
`on_all(servers, call)` runs `call(server)` on every server concurrently, one thread per server,
and raises one `ServerError` naming every server that failed (the others' calls still complete).

The calls of one process to one server share kept-alive connections (`connections`): a weight
push makes five calls per server in a few milliseconds, and a new connection and HTTP client per
call cost ~1 ms each of them on a busy 2-core machine (tools/bench/push_profile.py). They go
straight to the server, as the rollout client's `/generate` requests do (no proxy from the
environment). A call is sent again only when a kept connection was closed under it unanswered
(`ServerControl._request`).
"""
from __future__ import annotations

import http.client
import json
import math
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import urllib3

from megarl.rollout.protocol import error_message

# A kept connection idle for longer than this is closed instead of used again (seconds). The server
# closes a connection idle for its keep-alive timeout, uvicorn's `timeout_keep_alive` (5 s by
# default: the CPU engine's; SGLang 0.5.23 passes SGLANG_TIMEOUT_KEEP_ALIVE, 5 s, in
# `entrypoints/http_server.py::launch_server`), and a request sent just as it closes one fails
# unanswered; 2 s keeps 3 s clear of that. One the server closed sooner (a restart) is found
# closed before it is used (urllib3's `is_connection_dropped`) and replaced.
REUSE_IDLE_S = 2.0
# The connections kept per server: calls beyond this many at once open one more each, closed after.
CONNECTIONS_PER_SERVER = 8
# The calls that get no answer (no connection, a dropped one, none within the timeout).
UNANSWERED = (urllib3.exceptions.HTTPError, OSError)
# Whether the connection this thread's last request took from a pool was a kept one, open (set by
# `_IdleBound._get_conn`, read by `ServerControl._request`).
_took_kept_connection = threading.local()


class _IdleBound:
    """A urllib3 connection pool that does not reuse a connection idle for over REUSE_IDLE_S."""

    def _get_conn(self, timeout=None):
        conn = super()._get_conn(timeout)
        if time.monotonic() - getattr(conn, "megarl_idle_since", math.inf) > REUSE_IDLE_S:
            conn.close()  # it connects again when used
        _took_kept_connection.value = conn.is_connected
        return conn

    def _put_conn(self, conn) -> None:
        if conn is not None:
            conn.megarl_idle_since = time.monotonic()
        super()._put_conn(conn)


class _HTTPPool(_IdleBound, urllib3.HTTPConnectionPool):
    pass


class _HTTPSPool(_IdleBound, urllib3.HTTPSConnectionPool):
    pass


_pools: dict[str, urllib3.HTTPConnectionPool] = {}  # url -> its pool
_pools_pid: Optional[int] = None
_pools_lock = threading.Lock()


def connections(url: str) -> urllib3.HTTPConnectionPool:
    """This process's keep-alive connections to the server at `url` (`scheme://host:port`, a path
    ignored; a forked child makes its own)."""
    global _pools_pid
    with _pools_lock:
        if _pools_pid != os.getpid():
            _pools.clear()  # the parent's connections are not this process's to use
            _pools_pid = os.getpid()
        if url not in _pools:
            parsed = urllib3.util.parse_url(url)
            pool = _HTTPSPool if parsed.scheme == "https" else _HTTPPool
            _pools[url] = pool(parsed.host, parsed.port, maxsize=CONNECTIONS_PER_SERVER)
        return _pools[url]


class ServerError(RuntimeError):
    """An admin call that failed; the message names the server, endpoint, status and reason."""


class ServerControl:
    def __init__(self, url: str, api_key: Optional[str] = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._path = urllib3.util.parse_url(self.url).path or ""  # of the URL, before each endpoint's

    # ---------------------------------------------------------------- plumbing
    def _request(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None,
                 headers: Optional[dict] = None, query: Optional[dict] = None) -> urllib3.BaseHTTPResponse:
        """One HTTP exchange; `timeout_s` bounds connecting and each read (seconds); `query`: the
        URL's query parameters. Raises `UNANSWERED` errors.

        Sent again once, on a new connection, only when it went out on a kept connection that the
        server closed without a byte of answer: a server closes a kept-alive connection whenever it
        likes (RFC 9112 section 9.6), and one that closes it as the request arrives has not read the
        request. Go's net/http Transport retries the same case, any method included
        (`errServerClosedIdle`, `persistConn.shouldRetryRequest`). Any other failure is not retried."""
        timeout_s = timeout_s or self.timeout_s
        target = self._path + path + ("?" + urllib.parse.urlencode(query) if query else "")
        encoded = None if body is None else json.dumps(body).encode()
        headers = {**(headers or {}), **({} if body is None else {"Content-Type": "application/json"})}
        for attempt in (1, 2):
            _took_kept_connection.value = False
            try:
                return connections(self.url).request(
                    method, target, body=encoded, headers=headers,
                    timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s), retries=False, redirect=False,
                )
            except urllib3.exceptions.ProtocolError as e:
                cause = e.args[-1] if e.args else None  # urllib3 2.x: ("Connection aborted.", the error)
                closed_unanswered = isinstance(cause, (http.client.RemoteDisconnected, BrokenPipeError,
                                                       ConnectionResetError))
                if attempt == 2 or not (_took_kept_connection.value and closed_unanswered):
                    raise
        raise AssertionError("unreachable")

    def _call(self, method: str, path: str, body: Optional[dict] = None, timeout_s: Optional[float] = None,
              query: Optional[dict] = None) -> Any:
        try:
            resp = self._request(method, path, body, timeout_s, self._headers, query)
        except UNANSWERED as e:
            raise ServerError(f"{self.url}{path}: {type(e).__name__}: {e}") from e
        text = resp.data.decode("utf-8", "replace")
        try:
            payload = json.loads(text) if text else None
        except ValueError:
            payload = text
        if resp.status >= 400 or (isinstance(payload, dict) and payload.get("success") is False):
            message = error_message(payload, payload if isinstance(payload, str) else resp.reason)
            raise ServerError(f"{self.url}{path}: HTTP {resp.status}: {message}")
        return payload

    # ---------------------------------------------------------------- health and info
    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            return self._request("GET", "/health", timeout_s=timeout_s).status == 200
        except UNANSWERED:
            return False

    def wait_healthy(
        self, timeout_s: float, poll_s: float = 0.5, path: str = "/health", alive: Callable[[], bool] = lambda: True
    ) -> None:
        """Poll `path` until HTTP 200; raise `ServerError` on timeout or when `alive()` turns False."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not alive():
                raise ServerError(f"{self.url}: the server process exited while starting")
            try:
                if self._request("GET", path, timeout_s=min(5.0, timeout_s)).status == 200:
                    return
            except UNANSWERED:
                pass
            time.sleep(poll_s)
        raise ServerError(f"{self.url}{path}: not healthy after {timeout_s:.0f} s")

    def model_info(self) -> dict:
        return self._call("GET", "/model_info")

    def server_info(self) -> dict:
        return self._call("GET", "/server_info")

    def weight_version(self) -> str:
        return self.model_info()["weight_version"]

    # ---------------------------------------------------------------- scheduling
    def flush_cache(self, wait_s: float = 60.0) -> None:
        """Flush the prefix cache once the server is idle, waiting there up to `wait_s` seconds:
        SGLang 0.5.23's `/flush_cache?timeout=` (`entrypoints/http_server.py::flush_cache`;
        `managers/scheduler_components/flush_wrapper.py::SchedulerFlushWrapper`) flushes at once
        if the scheduler is idle, else in the first scheduler loop that finds it idle (a server
        that just answered its last request is idle a loop later), and refuses with HTTP 400 once
        `wait_s` passed (0: refuse at once if busy). The call's read bound is `timeout_s` + `wait_s`."""
        self._call("POST", "/flush_cache", timeout_s=self.timeout_s + wait_s, query={"timeout": f"{wait_s:g}"})

    def abort_all(self) -> None:
        self._call("POST", "/abort_request", {"abort_all": True})

    def abort(self, rid: str) -> None:
        self._call("POST", "/abort_request", {"rid": rid})

    def pause_generation(self, mode: str = "abort") -> None:
        """SGLang's `/pause_generation`: "abort" returns running requests' tokens so far (finish_reason
        abort); requests sent until `continue_generation` wait. Weight updates may run meanwhile."""
        self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", {})

    # ---------------------------------------------------------------- memory
    def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Free GPU memory (`weights`, `kv_cache`, `cuda_graph`; None = all). The server must be
        idle, or it ends: `release_memory_when_idle` waits for that."""
        self._call("POST", "/release_memory_occupation", {"tags": tags})

    def release_memory_when_idle(self, tags: Optional[list[str]] = None) -> None:
        """`release_memory_occupation` once the server is idle, as slime does: `flush_cache`
        first, which returns once the server is idle (within its wait). SGLang 0.5.23 asserts an
        idle scheduler on a release and its server exits on the AssertionError
        (managers/scheduler_components/weight_updater.py, `release_memory_occupation`), while it
        can still be busy after the last answer came back: a request the client gave up on runs
        on, and the scheduler holds a finished batch until its next loop (`Scheduler.is_fully_idle`:
        `running_batch`, `last_batch`, the overlap loop's `result_queue`). Its `/flush_cache` runs
        only when that same `is_fully_idle` holds (`SchedulerFlushWrapper`) and refuses with HTTP
        400 once its wait passed; nothing new is sent between the two calls."""
        self.flush_cache()
        self.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        """Re-occupy memory; resume `weights` before pushing new weights and `kv_cache` after."""
        self._call("POST", "/resume_memory_occupation", {"tags": tags})

    # ---------------------------------------------------------------- weights
    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Blocks until the whole group has joined: the trainer must join (rank 0) concurrently."""
        self._call(
            "POST",
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self) -> None:
        self._call("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._call("POST", "/end_weight_update", {})

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        load_format: Optional[str] = None,
        weight_version: Optional[str] = None,
        flush_cache: bool = True,
    ) -> None:
        """Blocks until the bucket is received: the trainer must broadcast it concurrently."""
        self._call(
            "POST",
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "load_format": load_format,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
            },
        )

    def update_weights_from_disk(
        self, model_path: str, weight_version: Optional[str] = None, abort_all_requests: bool = False
    ) -> None:
        self._call(
            "POST",
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": weight_version, "abort_all_requests": abort_all_requests},
        )


def _describe(server: ServerControl, error: BaseException) -> str:
    text = str(error)
    if isinstance(error, ServerError) and server.url in text:
        return text
    return f"{server.url}: {type(error).__name__}: {text}"


def outcomes(futures: dict[Future, ServerControl]) -> list[Any]:
    """Each future's result, or the exception its call raised (as a `ServerError` naming the
    server), in insertion order. (Each call is bounded by its `ServerControl.timeout_s`.)"""
    out = []
    for future, server in futures.items():
        try:
            out.append(future.result())
        except Exception as e:  # every server's failure is kept, not just the first
            out.append(ServerError(_describe(server, e)))
    return out


def wait_all(futures: dict[Future, ServerControl]) -> list[Any]:
    """Results of `futures` (one per server) in insertion order; raise one `ServerError` naming
    every server whose call failed."""
    results = outcomes(futures)
    failures = [str(r) for r in results if isinstance(r, ServerError)]
    if failures:
        raise ServerError("; ".join(failures))
    return results


# The threads of `on_all`, one pool per process, kept between rounds: a round of admin calls then
# starts no thread (a pool per round spent ~5 ms a weight push starting threads on a busy 2-core
# machine, py-spy, docs/benchmarks.md issue 28). The pool makes threads as rounds need them and
# reuses idle ones, so a round over N servers runs its N calls at once (up to ADMIN_THREADS).
ADMIN_THREADS = 256
_admin_pool: Optional[ThreadPoolExecutor] = None
_admin_pool_pid: Optional[int] = None
_admin_pool_lock = threading.Lock()


def admin_pool() -> ThreadPoolExecutor:
    """This process's pool for `on_all` (a forked child makes its own: the parent's threads are
    not in it)."""
    global _admin_pool, _admin_pool_pid
    with _admin_pool_lock:
        if _admin_pool is None or _admin_pool_pid != os.getpid():
            _admin_pool = ThreadPoolExecutor(ADMIN_THREADS, thread_name_prefix="server-admin-http")
            _admin_pool_pid = os.getpid()
        return _admin_pool


def on_all(servers: Sequence[ServerControl], call: Callable[[ServerControl], Any]) -> list[Any]:
    """`call(server)` on every server concurrently; results in server order, or one `ServerError`
    naming every server whose call failed. The weight push's admin calls go through it."""
    return wait_all(_submit(servers, call))


def on_each(servers: Sequence[ServerControl], call: Callable[[ServerControl], Any]) -> list[Any]:
    """`on_all` that does not raise: each server's result or its `ServerError`, in server order
    (the rollout fleet's memory release and resume, which go on for the servers that answered)."""
    return outcomes(_submit(servers, call))


def _submit(servers: Sequence[ServerControl], call: Callable[[ServerControl], Any]) -> dict[Future, ServerControl]:
    pool = admin_pool()
    return {pool.submit(call, s): s for s in servers}
