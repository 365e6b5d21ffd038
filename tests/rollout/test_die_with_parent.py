"""A server started by megarl (router, rollout server) dies with the process that started it, so a
SIGKILLed trainer or Ray worker leaves nothing running."""
import os
import signal
import subprocess
import sys
import time

PARENT = """
import subprocess, sys, time
from megarl.rollout.process import _die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=_die_with_parent,
                         start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_server_process_dies_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())  # the parent prints at once; bounded by the finally's kill
        os.kill(child, 0)  # running
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        os.kill(child, signal.SIGKILL)
        raise AssertionError(f"pid {child} outlived its killed parent by 30 s")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
