"""async_save (megarl.checkpoint.Checkpoints over megatron-core's asynchronous dist-checkpoint save):
a checkpoint becomes visible only once its background write finished, holds the tensors and the
controller state of its own step whatever training does meanwhile, is committed before the next
save, and one whose write a crash interrupted is never resumed from (async_save_world.py holds
each write at a gate the test opens)."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from megarl import checkpoint
from megarl.config import load_config
from megarl.net import free_port

WORLD = Path(__file__).with_name("async_save_world.py")
TIMEOUT_S = 120


def test_a_checkpoint_is_visible_only_once_its_background_write_finished(tmp_path):
    root, gate = tmp_path / "p" / "e", tmp_path / "gate"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(checkpoint.__file__).parents[2]),
                                                                      os.environ.get("PYTHONPATH", "")] if p)}
    # its own process group: the crash below kills it with its forked writer and megatron's results-queue server
    world = subprocess.Popen([sys.executable, str(WORLD), str(root), str(gate), str(free_port("127.0.0.1"))],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    crash = threading.Timer(TIMEOUT_S, os.killpg, (world.pid, signal.SIGKILL))  # bounds every read below
    crash.start()
    lines = {}
    try:
        for line in world.stdout:
            what, tab, value = line.rstrip("\n").partition("\t")
            if tab:
                lines[what] = value
            if what == "pending 4":
                break
    finally:
        crash.cancel()
        os.killpg(world.pid, signal.SIGKILL)  # a crash after the save of step 4 returned, its write unfinished
        _, stderr = world.communicate(timeout=30)
    assert "pending 4" in lines, stderr[-3000:]

    # save 1 returned while its write was held: nothing visible, the poll at the step boundary commits nothing
    assert lines["save 1 returned"] == "None" and lines["poll while held"] == "None"
    assert (lines["complete while held"], lines["latest while held"]) == ("[]", "False")
    # once written, the next poll commits it, with the tensors and the controller state of step 1 as they were
    # when the save returned, though training (and the controller) changed them while the write was held
    assert lines["poll after the write"] == "global_step_1"
    assert lines["saved w is the staged w"] == "True"
    assert lines["saved controller state"] == "{'step': 1, 'sampler': {'position': 4}}"
    # the next save commits the pending one first; retention (max_actor_ckpt_to_keep=2) once 3 is committed
    assert (lines["save 2 returned"], lines["save 3 returned"]) == ("None", "None")
    assert lines["complete after save 3"] == "[1, 2]"
    assert (lines["finish"], lines["complete after finish"]) == ("global_step_3", "[2, 3]")
    # the crash left step 4 half-written: the previous checkpoint is the latest, and the one a resume picks
    assert (lines["save 4 returned"], lines["pending 4"]) == ("None", "True")
    assert (root / checkpoint.LATEST).read_text().strip() == "global_step_3"
    config = load_config(None, [f"trainer.default_local_dir={tmp_path}", "trainer.project_name=p",
                                "trainer.experiment_name=e"])
    assert checkpoint.find_resume_dir(config) == root / "global_step_3"
    (partial,) = root.glob("global_step_4*")
    assert partial.name.startswith("global_step_4.tmp-") and not (partial / checkpoint.COMPLETE).exists()
