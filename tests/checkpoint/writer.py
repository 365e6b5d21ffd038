"""Writes checkpoints of steps start, start+1, ... forever (until killed), each holding a payload
file and the payload's SHA-256 in its controller state: a checkpoint is consistent when they agree.
Used by test_checkpoint.py, which SIGKILLs the writers at random moments.

    python writer.py ROOT KEEP

Imports once, prints `ready`, then for each line `START` read from stdin forks a writer that starts
at step START, prints its pid, and prints `reaped` once that writer was killed. Ends at stdin's end.
"""
import hashlib
import os
import sys
from pathlib import Path

from megarl import checkpoint
from megarl.config import ExperimentConfig


def write_forever(root: Path, step: int, keep: int) -> None:
    while True:
        payload = os.urandom(4 << 20)  # 4 MiB: long enough to be killed mid-write now and then
        tmp = checkpoint.begin(root, step)
        (tmp / "actor").mkdir()
        (tmp / "actor" / "payload.bin").write_bytes(payload)
        checkpoint.commit(tmp, step, ExperimentConfig(), {"step": step, "sha": hashlib.sha256(payload).hexdigest()},
                          keep=keep)
        step += 1


root, keep = Path(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            write_forever(root, int(line), keep)
        finally:
            os._exit(1)  # never back into this loop
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
