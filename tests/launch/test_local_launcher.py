"""launch/local.sh end to end: a 2-node Ray cluster on this machine sized from the config, the
cluster check, an experiment that connects to that cluster (here `megarl check-cluster`, which
checks it again from outside), and only the started processes stopped."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "slurm" / "tiny_2node.yaml"  # 2 nodes x 2 GPUs, split pools


@pytest.mark.slow
def test_local_launcher_runs_the_experiment_on_a_two_node_cluster_and_stops_it(tmp_path):
    ray_tmp = Path(tempfile.mkdtemp(prefix="mgl", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(MEGARL_TMPDIR=str(ray_tmp), MEGARL_ENTRY="-m megarl.cli check-cluster")
    try:
        done = subprocess.run([str(REPO / "launch" / "local.sh"), "--config", str(CONFIG)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        assert "Ray node 0 (node0) joined" in out and "Ray node 1 (node1) joined" in out
        # Checked twice: by the launcher, then by the experiment through RAY_ADDRESS and the token.
        ok = "cluster check OK: 2 node(s) ['node0', 'node1'] x 2 GPU(s); gloo all-reduce over 4 ranks = 10"
        assert out.count(ok) == 2
        assert "the experiment exited with status 0" in out
        left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(ray_tmp) in " ".join(p.info["cmdline"] or [])]
        assert not left, f"processes left behind: {left}"
        assert list(ray_tmp.iterdir()) == [], "the launch's temp dir was not removed"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
