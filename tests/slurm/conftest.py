"""A real Slurm (Debian's slurmctld + slurmd) on this host for the module: 4 simulated nodes with 2
fake GPUs each, from tools/slurm_sandbox.sh, stopped by PID afterwards. Installing Slurm needs
root; where that is impossible the tests fail (they do not skip) with the command to run."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from megarl.net import port_is_free

REPO = Path(__file__).resolve().parents[2]
SANDBOX = REPO / "tools" / "slurm_sandbox.sh"
VENV_BIN = Path(sys.executable).parent
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports (slurmctld, then one per slurmd)."""
    for base in range(7100, 7900, 10):
        if all(port_is_free(port) for port in range(base, base + count)):
            return base
    raise RuntimeError("no free ports for the Slurm sandbox in 7100-7900")


@dataclass
class Sandbox:
    dir: Path
    ray_tmp: Path  # MEGARL_TMPDIR for the jobs: short, private to this module

    def env(self, **extra: str) -> dict[str, str]:
        """The environment to submit with (sbatch passes it to the job): this venv first on PATH,
        no Ray settings from the test process."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(SLURM_CONF=str(self.dir / "etc" / "slurm.conf"), PATH=f"{VENV_BIN}:{env.get('PATH', '')}",
                   MEGARL_TMPDIR=str(self.ray_tmp))
        env.update(extra)
        return env

    def sbatch(self, args: list[str], cwd: Path, **env: str) -> str:
        done = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=self.env(**env), capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def scontrol(self, *args: str) -> str:
        return subprocess.run(["scontrol", *args], env=self.env(), capture_output=True, text=True, timeout=30).stdout

    def job(self, job_id: str) -> dict[str, str]:
        out = self.scontrol("show", "job", "-o", job_id)
        return dict(re.findall(r"(JobState|ExitCode|Restarts|Reason|RunTime)=(\S+)", out))

    def wait_for(self, job_id: str, done, timeout_s: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if done(info):
                return info
            if info.get("JobState") in FINISHED:
                raise AssertionError(f"job {job_id} ended before {what}: {info}")
            time.sleep(0.5)
        raise AssertionError(f"job {job_id}: {what} not reached within {timeout_s:g} s; last state {self.job(job_id)}")

    def wait_finished(self, job_id: str, timeout_s: float = 150) -> dict[str, str]:
        return self.wait_for(job_id, lambda i: i.get("JobState") in FINISHED, timeout_s, "the end")

    def assert_cleaned_up(self, job_id: str) -> None:
        """No process of the job's Ray cluster is left, nor its temp dir."""
        temp = str(self.ray_tmp / f"megarl-{job_id}")
        left = [f"{p.pid}: {' '.join(p.info['cmdline'])[:200]}" for p in psutil.process_iter(["cmdline"])
                if temp in " ".join(p.info["cmdline"] or [])]
        assert not left, f"processes left behind: {left}"
        assert not Path(temp).exists(), f"{temp} left behind"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    deps = subprocess.run([str(SANDBOX), "deps"], capture_output=True, text=True, timeout=600)
    if deps.returncode != 0:
        pytest.fail(f"Slurm is needed for these tests and could not be installed:\n{deps.stdout}{deps.stderr}")
    root = tmp_path_factory.mktemp("slurm")
    ray_tmp = Path(tempfile.mkdtemp(prefix="mgs", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    up = subprocess.run([str(SANDBOX), "up", str(root), "--nodes", "4", "--gpus", "2", "--cpus", "2",
                         "--port", str(_free_port_run(5))], capture_output=True, text=True, timeout=120)
    if up.returncode != 0:
        pytest.fail(f"the Slurm sandbox did not come up:\n{up.stdout}{up.stderr}")
    try:
        yield Sandbox(root, ray_tmp)
    finally:
        subprocess.run([str(SANDBOX), "down", str(root)], capture_output=True, timeout=120)
        shutil.rmtree(ray_tmp, ignore_errors=True)
