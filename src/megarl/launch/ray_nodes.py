"""Start Ray nodes as child processes (`ray start --block`, behind `srun` on Slurm), one at a time,
wait for each to join the cluster, and stop exactly those processes (never `ray stop`, which kills
every Ray process on the machine).

Every node gets `--num-gpus` explicitly (Ray detects 0 GPUs inside Slurm and on CPU machines) and
two labels: `megarl-node-rank=k`, so that plan node k is this node, and, on Slurm,
`slurm-node=<name>`. See ../shared/reference/ray-and-slurm-on-cpu.md for the measured gotchas.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray

from megarl.launch.settings import NodeLaunch, RaySettings
from megarl.placement.ray_pools import NODE_RANK_LABEL

# The venv's Ray, whatever PATH says: the raylet then starts its workers with this same Python.
RAY_START = (sys.executable, "-m", "ray.scripts.scripts", "start")


class NodeStartError(RuntimeError):
    """A Ray node did not join. The message names the node and quotes its `ray start` log."""


def ray_start_command(node: NodeLaunch, settings: RaySettings) -> list[str]:
    """The full command line that starts `node` (rank 0 is the head)."""
    labels = {NODE_RANK_LABEL: str(node.rank), **node.labels}
    args = [
        *RAY_START, "--block", "--disable-usage-stats",
        f"--num-gpus={settings.gpus_per_node}", f"--num-cpus={settings.cpus_per_node}",
        "--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()),
        "--dashboard-agent-listen-port=0",  # the default 52365 collides between nodes sharing a host
    ]
    if node.rank == 0:
        args += ["--head", f"--node-ip-address={settings.head_ip}", f"--port={settings.port}",
                 f"--ray-client-server-port={settings.client_port}", "--include-dashboard=false"]
    else:
        args += [f"--address={settings.address}"]
    return [*node.prefix, *settings.wrapper, *args, *settings.extra_args]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    | " + line for line in text[-lines:]) or "    | (empty)"


class RayNodes:
    """The `ray start --block` processes this launcher started, in start order. Connects this
    process to the cluster as a driver once the head is up (`ray.init`)."""

    def __init__(self, settings: RaySettings, log_dir: Path):
        self.settings, self.log_dir = settings, log_dir
        self.started: list[tuple[NodeLaunch, subprocess.Popen, Path]] = []
        self.joined: list[NodeLaunch] = []

    def start_all(self, nodes: list[NodeLaunch], log=print) -> None:
        """Start the nodes one at a time (concurrent starts on one host race for ports), each
        awaited; raises NodeStartError naming the first node that does not join in time."""
        for node in nodes:
            t0 = time.monotonic()
            self._start(node)
            self._wait_joined(node)
            self.joined.append(node)
            log(f"Ray node {node.rank} ({node.name}) joined in {time.monotonic() - t0:.1f} s")

    def _start(self, node: NodeLaunch) -> None:
        log_path = self.log_dir / f"ray-start-{node.rank}-{node.name}.log"
        with open(log_path, "w") as out:
            proc = subprocess.Popen(ray_start_command(node, self.settings), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **node.env},
                                    start_new_session=True)  # a Ctrl-C reaches the launcher, not Ray
        self.started.append((node, proc, log_path))

    def _fail(self, node: NodeLaunch, why: str) -> NodeStartError:
        log_path = self.started[-1][2]
        return NodeStartError(
            f"Ray on node {node.name} (plan node {node.rank}) {why}. Its `ray start` output ({log_path}) ends with:\n"
            f"{_tail(log_path)}\n"
            f"  The job stops here rather than wait on a bad node; on Slurm, resubmit with --exclude={node.name}."
        )

    def _wait_joined(self, node: NodeLaunch) -> None:
        proc = self.started[-1][1]
        deadline = time.monotonic() + self.settings.join_timeout_s

        def check_alive():
            if proc.poll() is not None:
                raise self._fail(node, f"exited with status {proc.returncode} before joining")
            if time.monotonic() > deadline:
                raise self._fail(node, f"did not join within {self.settings.join_timeout_s:g} s")

        if node.rank == 0:
            # ray.init blocks for minutes on a GCS that is not there: wait for its port first.
            while not accepts_connections(self.settings.head_ip, self.settings.port):
                check_alive()
                time.sleep(0.2)
            try:
                ray.init(address=self.settings.address, log_to_driver=False, logging_level="ERROR")
            except Exception as exc:  # noqa: BLE001 - any failure to connect is this node's failure
                raise self._fail(node, f"did not accept a driver connection ({type(exc).__name__}: {exc})") from exc
        while not _node_alive(node.rank):
            check_alive()
            time.sleep(0.25)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to every started node (workers first), then SIGKILL whatever is left."""
        if ray.is_initialized():
            ray.shutdown()
        for _, proc, _ in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc, _ in reversed(self.started):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.started, self.joined = [], []


def accepts_connections(host: str, port: int) -> bool:
    """Whether something listens on host:port (a GCS, before ray.init waits minutes on it)."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _node_alive(rank: int) -> bool:
    return any(n["Alive"] and n["Labels"].get(NODE_RANK_LABEL) == str(rank) for n in ray.nodes())
