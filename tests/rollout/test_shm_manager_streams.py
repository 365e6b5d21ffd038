"""torch's shared-memory helper never holds megarl's standard streams.

The first CPU tensor megarl shares by file name (`rollout.tensor_payload`, the tensor weight-sync
transport) makes torch fork + exec `torch_shm_manager` (torch/lib/libshm/core.cpp::start_manager:
only its stdout is replaced, by the pipe it reports its socket through). The helper lives until
the last process connected to it has gone (libshm/manager.cpp: it exits 2 s after its last
client), and every rollout server that opened a shared file is such a process. A caller reading
megarl's output through a pipe (`megarl train ... 2>&1 | tee log`, subprocess.run(capture_output=
True)) waits for EOF, which the helper would hold back for as long as a server lives.

Here: a process shares a tensor through megarl's own code path, hands it to a "server" that opens
it and lives on in its own session (its own streams /dev/null, as a server's log file), then exits.
The caller's pipes must reach EOF as that process exits; the bound is a hang bound, not a speed
limit: without the fix the call waits the whole bound (the server lives longer)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HANG_BOUND_S = 60  # the child takes a few seconds (two Python processes importing torch)

SERVER = r"""
import sys, time
from megarl.rollout import tensor_payload

tensors = tensor_payload.named_tensors(tensor_payload.deserialize(sys.argv[1]), None)  # joins the helper
assert tensors[0][1].tolist() == [0.0, 1.0, 2.0, 3.0]
open(sys.argv[2], "w").close()
time.sleep(300)  # a server that outlives the process that shared (stopped by the test, by PID)
"""

CLIENT = r"""
import os, subprocess, sys, time
import psutil
import torch
from megarl.rollout import tensor_payload

server_code, ready, pid_file = sys.argv[1:4]
copy = tensor_payload.shared_cpu_copy(torch.arange(4.0))
entry = tensor_payload.serialize([("w", copy)])
server = subprocess.Popen([sys.executable, "-c", server_code, entry, ready], stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
with open(pid_file, "w") as f:
    f.write(str(server.pid))
deadline = time.monotonic() + 50
while not os.path.exists(ready) and server.poll() is None and time.monotonic() < deadline:
    time.sleep(0.05)
helpers = [p for p in psutil.Process().children() if p.name().startswith("torch_shm")]
print("server ready", os.path.exists(ready), "exit", server.poll(), flush=True)
print("helpers", len(helpers), flush=True)
for p in helpers:
    print("helper streams", [os.readlink(f"/proc/{p.pid}/fd/{fd}") for fd in (0, 1, 2)
                             if os.path.exists(f"/proc/{p.pid}/fd/{fd}")], flush=True)
print("client streams", [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)], flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc")
def test_a_piped_caller_gets_eof_when_the_sharing_process_exits_while_a_server_lives_on(tmp_path):
    ready, pid_file = tmp_path / "ready", tmp_path / "server.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    try:
        try:
            done = subprocess.run([sys.executable, "-c", CLIENT, SERVER, str(ready), str(pid_file)],
                                  capture_output=True, text=True, timeout=HANG_BOUND_S, env=env)
        except subprocess.TimeoutExpired as hung:
            out = hung.stdout.decode() if isinstance(hung.stdout, bytes) else hung.stdout
            pytest.fail(f"the caller's pipes stayed open {HANG_BOUND_S} s after the sharing process exited "
                        f"(torch_shm_manager holds them while the server lives); its output:\n{out}")
        elapsed = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        assert "server ready True exit None" in done.stdout, done.stdout  # the server opened the share and lives
        assert "helpers 1" in done.stdout, done.stdout  # the share did start torch's helper
        client_pipe = done.stdout.split("client streams ")[1].splitlines()[0]
        helper = done.stdout.split("helper streams ")[1].splitlines()[0]
        assert "pipe:" in client_pipe and "/dev/null" in helper
        # none of the caller's pipes is among the helper's standard streams
        for stream in eval(client_pipe):  # noqa: S307 (our own child's repr of two strings)
            assert stream not in eval(helper), (stream, helper)  # noqa: S307
        assert elapsed < HANG_BOUND_S
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the server: gone, and the helper 2 s later
            except ProcessLookupError:
                pass
