"""A server subprocess that is started, health-checked, restarted after a crash, and stopped by PID.

The process gets a session (and process group) of its own, so stopping it also stops the children
it spawned (SGLang's scheduler and detokenizer): SIGTERM to the group, then SIGKILL after a timeout.
Its stdout and stderr go to a log file whose tail is quoted when it fails to start.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional, TypeVar

from megarl.net import free_port
from megarl.rollout.control import ServerControl, ServerError

log = logging.getLogger(__name__)


def log_tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def exit_description(code: Optional[int]) -> str:
    """'exit code 3', 'killed by SIGKILL' (a negative Popen return code), or 'exit code unknown'."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _new_log_file(name: str) -> str:
    fd, path = tempfile.mkstemp(prefix=f"megarl-{name}-", suffix=".log")
    os.close(fd)
    return path


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None  # resolved before any fork


def _die_with_parent() -> None:
    """Run in the child before exec: Linux sends it SIGTERM when the process that started it dies,
    so a server or router never outlives a killed trainer or Ray worker."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _fate_sharing():
    """`_die_with_parent` when called from the main thread. Linux ties the signal to the *thread*
    that started the child, so a server started from a short-lived thread (a thread pool, a
    restart from a monitor) would be killed when that thread ends: those are not tied."""
    on_linux_main = _prctl is not None and threading.current_thread() is threading.main_thread()
    return _die_with_parent if on_linux_main else None


def _without_secrets(command: list[str]) -> list[str]:
    """`command` with the value of --api-key replaced by ***."""
    return [("***" if i > 0 and command[i - 1] == "--api-key" else arg) for i, arg in enumerate(command)]


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message quotes its log. `port_taken`: it
    could not bind its port (another process bound it first)."""

    def __init__(self, message: str, port_taken: bool = False):
        super().__init__(message)
        self.port_taken = port_taken


def says_port_taken(log_text: str) -> bool:
    """Whether a server's log says its port was already bound: uvicorn (SGLang 0.5.23's HTTP server
    and the CPU engine's) logs "[Errno 98] error while attempting to bind on address ...: address
    already in use"; Rust's std (sglang-router) "Address already in use (os error 98)"."""
    return "address already in use" in log_text.lower()


Server = TypeVar("Server")  # a ServerProcess, or a Router


def start_on_a_free_port(make: Callable[[int], Server], host: str, attempts: int = 3) -> Server:
    """Build a server with `make(port)` on a port of `host` that was free a moment ago, and start it.
    A free port is only free until someone binds it: when another process (a client's ephemeral
    source port, another server) took it first, start again on a new port, at most `attempts` times.
    The server: a `ServerProcess`, or what starts one and names it the same way (`name`, `url`,
    `start()` raising `ServerStartError`: megarl.rollout.router.Router)."""
    for _ in range(attempts - 1):
        server = make(free_port(host))
        try:
            server.start()
            return server
        except ServerStartError as e:
            if not e.port_taken:
                raise
            log.warning("%s: another process bound %s first; starting on another port", server.name, server.url)
    server = make(free_port(host))
    server.start()
    return server


class ServerProcess:
    def __init__(
        self,
        name: str,
        command: list[str],
        url: str,
        *,
        health_path: Optional[str] = "/health",
        env: Optional[dict[str, str]] = None,
        log_path: Optional[str] = None,
        startup_timeout_s: float = 300.0,
    ):
        self.name = name
        self.command = command
        self.url = url.rstrip("/")
        self.health_path = health_path
        self.env = env
        self.log_path = log_path or _new_log_file(name)
        self.startup_timeout_s = startup_timeout_s
        self.restarts = 0
        self._wanted = False  # started successfully and not stopped: restart it if it dies
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.RLock()

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> Optional[int]:
        """The exit status once the process ended on its own (negative: killed by that signal)."""
        return self._proc.poll() if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the process and wait until `health_path` answers 200 (None: a process that serves
        no HTTP, e.g. node >= 1 of a multi-node SGLang server: started is all there is to wait for)."""
        with self._lock:
            if self.is_running():
                raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log_file:
                logged_before = log_file.tell()  # this start's lines come after
                # a header per start: the file says what it logs even when the process itself is quiet
                # (the router at --log-level warn writes nothing while all is well)
                log_file.write(f"# megarl: {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name} started: "
                               f"{shlex.join(_without_secrets(self.command))}\n".encode())
                log_file.flush()
                self._proc = subprocess.Popen(
                    self.command, stdout=log_file, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                    preexec_fn=_fate_sharing(),
                )
            log.info("%s started: pid %d, log %s", self.name, self._proc.pid, self.log_path)
            if self.health_path is None:
                self._wanted = True
                return
            try:
                ServerControl(self.url).wait_healthy(
                    self.startup_timeout_s, path=self.health_path, alive=self.is_running
                )
            except ServerError as e:
                self._terminate()
                raise ServerStartError(
                    f"{self.name} did not start: {e}\n--- {self.log_path} ---\n{log_tail(self.log_path)}",
                    port_taken=says_port_taken(_read_from(self.log_path, logged_before)),
                ) from None
            self._wanted = True

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop for good (no restart): SIGTERM the process group, SIGKILL it after `timeout_s`."""
        with self._lock:
            self._wanted = False
            self._terminate(timeout_s)

    def _terminate(self, timeout_s: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout_s)
                break
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored %s", self.name, proc.pid, sig.name)
        try:  # children that outlived the leader (same process group)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self, reason: str, timeout_s: float = 15.0) -> None:
        """SIGKILL the process group now and reap the process, for a server that is alive but does
        not answer (SIGSTOPped, deadlocked: it would not act on SIGTERM). `reason` goes into the log
        file. The process stays the one `pid`, `returncode` (-9) and `ensure_running` see, so the
        next `ensure_running` starts it again as after a crash."""
        with self._lock:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return
            with open(self.log_path, "ab") as log_file:
                log_file.write(f"# megarl: {time.strftime('%Y-%m-%d %H:%M:%S')} {self.name} (pid {proc.pid}) "
                               f"killed (SIGKILL to its process group): {reason}\n".encode())
            log.warning("%s (pid %d): killing its process group (SIGKILL): %s", self.name, proc.pid, reason)
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
            except ProcessLookupError:
                pass
            proc.wait(timeout=timeout_s)  # reaped: no zombie left

    def restart(self) -> None:
        """Stop the process if it runs and start it again, same command and URL (the nodes of a
        multi-node server restart together: one alone cannot rejoin the others)."""
        with self._lock:
            self._terminate()
            self.restarts += 1
            self.start()

    def ensure_running(self) -> bool:
        """Restart the process if it exited on its own; True when it restarted it.
        Raises `ServerStartError` if the restart fails (the next call tries again)."""
        with self._lock:
            if not self._wanted or self.is_running():
                return False
            if self._proc is not None:
                log.warning("%s (pid %d) exited with %s; restarting", self.name, self._proc.pid, self._proc.returncode)
                self._terminate()
            self.restarts += 1
            self.start()
            return True


class ProcessMonitor:
    """A thread that restarts crashed processes every `interval_s` and reports each restart."""

    def __init__(
        self,
        processes: list[ServerProcess],
        interval_s: float = 1.0,
        on_restart: Callable[[ServerProcess], None] = lambda p: None,
    ):
        self.processes = processes
        self.interval_s = interval_s
        self.on_restart = on_restart
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-process-monitor", daemon=True)

    def start(self) -> ProcessMonitor:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for proc in self.processes:
                try:
                    if proc.ensure_running():
                        self.on_restart(proc)
                except ServerStartError:
                    log.exception("restarting %s failed; will try again", proc.name)
