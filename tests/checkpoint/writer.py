"""Writes checkpoints of steps start, start+1, ... forever (until killed), each holding a payload
file and the payload's SHA-256 in its controller state: a checkpoint is consistent when they agree.
Used by test_checkpoint.py, which SIGKILLs it at random moments."""
import hashlib
import os
import sys
from pathlib import Path

from megarl import checkpoint
from megarl.config import ExperimentConfig

root, start, keep = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
step = start
print("ready", flush=True)
while True:
    payload = os.urandom(4 << 20)  # 4 MiB: long enough to be killed mid-write now and then
    tmp = checkpoint.begin(root, step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "payload.bin").write_bytes(payload)
    checkpoint.commit(tmp, step, ExperimentConfig(), {"step": step, "sha": hashlib.sha256(payload).hexdigest()},
                      keep=keep)
    print(step, flush=True)
    step += 1
