"""Run untrusted Python in a subprocess with time, memory and output limits and no network.

Each run gets a fresh scratch directory (its working directory, HOME and TMPDIR), removed
afterwards. The child (`sandbox_runner.py`) limits itself and refuses sockets, ctypes, new
processes and writes outside the scratch directory (see its docstring); where the kernel allows
it, it also enters an empty network namespace (`RunResult.network_isolated`). The child runs in
its own session, so a timeout kills it and anything it started. This is a guard against
accidents of model-written code (infinite loops, memory blow-ups, stray file writes, network
calls), not a boundary against a deliberate attacker: for that, run rewards in a container.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

RUNNER = Path(__file__).with_name("sandbox_runner.py")


@dataclass(frozen=True)
class RunResult:
    status: str  # "ok" (exit 0), "error" (other exit status or killed), "timeout"
    returncode: Optional[int]  # None after a wall-clock timeout
    stdout: str
    stderr: str
    wall_s: float
    network_isolated: bool  # ran inside an empty network namespace


def run_python(
    source: str,
    stdin: str = "",
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_output_mb: int = 16,
    isolate_network: bool = True,
    scratch_root: Optional[str] = None,
) -> RunResult:
    """Run `source` as a Python program fed `stdin`.

    timeout_s: CPU seconds allowed (rounded up to whole seconds); a program that sleeps or blocks
    is stopped after 2 * timeout_s + 1 wall-clock seconds. memory_mb: address-space limit.
    max_output_mb: largest stdout/stderr (and any file) the program may write.
    """
    if timeout_s <= 0 or memory_mb <= 0 or max_output_mb <= 0:
        raise ValueError(f"sandbox limits must be > 0: timeout_s={timeout_s}, memory_mb={memory_mb}, "
                         f"max_output_mb={max_output_mb}")
    scratch = tempfile.mkdtemp(prefix="megarl-sandbox-", dir=scratch_root)
    try:
        source_path = os.path.join(scratch, "solution.py")
        with open(source_path, "w", encoding="utf-8") as f:
            f.write(source)
        max_bytes = max_output_mb * 1024 * 1024
        settings = {
            "scratch": scratch,
            "source_path": source_path,
            "memory_bytes": memory_mb * 1024 * 1024,
            "cpu_seconds": max(1, math.ceil(timeout_s)),
            "max_file_bytes": max_bytes,
            "isolate_network": isolate_network,
        }
        env = {
            "PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }
        stdout_path, stderr_path = os.path.join(scratch, ".stdout"), os.path.join(scratch, ".stderr")
        started = time.monotonic()
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(RUNNER), json.dumps(settings)],
                stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=scratch, env=env, start_new_session=True,
            )
            try:
                proc.communicate(stdin.encode("utf-8", errors="replace"), timeout=2 * timeout_s + 1)
            except subprocess.TimeoutExpired:
                pass
            finally:
                returncode: Optional[int] = proc.returncode
                if returncode is None:  # timed out or interrupted, not reaped yet: kill its whole session
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        wall_s = time.monotonic() - started
        if returncode is None or returncode == -signal.SIGXCPU:
            status = "timeout"
        else:
            status = "ok" if returncode == 0 else "error"
        netns_path = os.path.join(scratch, ".netns")
        isolated = os.path.exists(netns_path) and Path(netns_path).read_text() == "1"
        return RunResult(status, returncode, _read(stdout_path, max_bytes), _read(stderr_path, max_bytes),
                         wall_s, isolated)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _read(path: str, max_bytes: int) -> str:
    with open(path, "rb") as f:
        return f.read(max_bytes).decode("utf-8", errors="replace")
