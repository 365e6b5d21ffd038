"""Signals always work (issue 42): with the driver blocked on a training worker that will never
answer (stopped with SIGSTOP mid-run), Ctrl-C, or a second SIGTERM, ends the run within seconds
with the exit status that says so, every process the run started (Ray's daemons and workers, the
rollout servers, the router) is gone, and the last complete checkpoint stands.

Before issue 42 the driver sat in one `ray.wait` of up to an hour inside Ray's C code, where
Python runs no signal handler, and Ctrl-C changed nothing."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.checkpoint import complete_checkpoints

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
STOP_BOUND_S = 30  # from the stopping signal to the driver's exit, its teardown included (s)
START_TIMEOUT_S = 300


def start(tiny: Path, out: Path) -> subprocess.Popen:
    """configs/tiny/grpo.yaml (one actor rank, one server) for many steps, a checkpoint every step."""
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo.yaml"),
           f"actor_rollout_ref.model.path={tiny / 'model'}", f"data.train_files={tiny / 'data/train.parquet'}",
           f"data.val_files={tiny / 'data/val.parquet'}", f"trainer.default_local_dir={out}",
           "trainer.total_training_steps=1000", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=false", "trainer.logger=[console]"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=out,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("signals, exit_code", [(["SIGINT"], 130), (["SIGTERM", "SIGTERM"], 143)],
                         ids=["ctrl-c", "sigterm-twice"])
def test_a_stop_signal_ends_a_run_blocked_on_a_stuck_worker(signals, exit_code, tiny_assets, tmp_path):
    proc = start(tiny_assets, tmp_path)
    run_dir = tmp_path / "megarl-tiny" / "grpo"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not complete_checkpoints(run_dir):
            assert proc.poll() is None, f"the run exited ({proc.returncode}):\n{proc.stdout.read()[-5000:]}"
            assert time.monotonic() < deadline, f"no checkpoint within {START_TIMEOUT_S} s"
            time.sleep(0.05)
        started = [proc_ for proc_ in psutil.Process(proc.pid).children(recursive=True)]
        workers = [p for p in started if "TrainWorker" in " ".join(p.cmdline())]
        assert workers and any("megarl.rollout.cpu.server" in " ".join(p.cmdline()) for p in started), [p.cmdline() for p in started]
        for worker in workers:
            worker.send_signal(signal.SIGSTOP)  # the next call on the actor never answers
        time.sleep(3)  # the driver is now waiting on it (the step's next call)
        assert proc.poll() is None
        t0 = time.monotonic()
        for name in signals:
            proc.send_signal(getattr(signal, name))  # to the driver alone, as the launchers do
            time.sleep(1)
        output, _ = proc.communicate(timeout=STOP_BOUND_S + 30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == exit_code, output[-5000:]
    assert elapsed < STOP_BOUND_S, (elapsed, output[-3000:])
    assert f"stopped by {signals[-1]}" in output and "no new checkpoint (the step was abandoned)" in output
    deadline = time.monotonic() + 30  # Ray's daemons end just after the driver
    while left := [p for p in started if alive(p)]:
        assert time.monotonic() < deadline, [(p.pid, p.cmdline()) for p in left]
        time.sleep(0.1)
    steps = [step for step, _ in complete_checkpoints(run_dir)]
    assert steps and steps == sorted(steps), steps
    assert f"with trainer.resume_mode=auto the next run continues from step {steps[-1]}" in output
