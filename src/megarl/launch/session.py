"""One launch, the same on one machine and on Slurm: start the Ray nodes one by one, check the
cluster against the plan, run the experiment, and stop the nodes, whatever happened.

Signals: SIGTERM, SIGINT and SIGUSR1 (Slurm's warning before the time limit or a preemption) reach
the experiment as one SIGTERM, which means "checkpoint and stop"; the launcher then waits for it to
exit. Before the experiment runs, they abort the launch.

Importing this module imports Ray: set `settings.ray_process_env` first.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
from dataclasses import dataclass, field

import ray

from megarl.launch.check import CLUSTER_FAILURE_EXIT, ClusterCheckError, check_cluster
from megarl.launch.ray_nodes import NodeStartError, RayNodes
from megarl.launch.settings import NodeLaunch, RaySettings
from megarl.placement.planner import Plan

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Interrupted(BaseException):
    """A signal before the experiment started. A BaseException, like KeyboardInterrupt, so that
    Ray's and our own `except Exception` let it through."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalForwarder:
    """Installed for the whole launch. Until the experiment starts, a signal interrupts the launch;
    while it runs, the signal becomes one SIGTERM to it; afterwards, signals are only recorded."""

    def __init__(self):
        self.received: list[int] = []
        self.forwarded: list[int] = []  # received while the experiment ran
        self.child: subprocess.Popen | None = None
        self.interruptible = True
        self._previous = {s: signal.signal(s, self._handle) for s in FORWARDED_SIGNALS}

    def _handle(self, signum, _frame):
        self.received.append(signum)
        if self.child is not None and self.child.poll() is None:
            self.forwarded.append(signum)
            self.child.send_signal(signal.SIGTERM)
        elif self.interruptible:
            raise Interrupted(signum)

    def run(self, command: list[str], env: dict[str, str]) -> int:
        """Run the experiment (in its own session: a Ctrl-C reaches it once, through here) and
        return its exit status, 128 + N when signal N ended it."""
        self.interruptible = False
        before = len(self.received)
        self.child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        if len(self.received) > before:  # a signal came while it was starting
            self.forwarded += self.received[before:]
            self.child.send_signal(signal.SIGTERM)
        rc = self.child.wait()
        return rc if rc >= 0 else 128 - rc

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclass
class SessionResult:
    exit_code: int
    joined: list[NodeLaunch]  # the nodes whose Ray started (their temp dirs exist)
    signals: list[int] = field(default_factory=list)  # all signals received
    experiment_signals: list[int] = field(default_factory=list)  # those passed on to the experiment


def run_session(plan: Plan, nodes: list[NodeLaunch], settings: RaySettings, experiment: list[str],
                check_timeout_s: float = 180.0, log=print) -> SessionResult:
    """Start `nodes` (nodes[0] is the head), check the cluster against `plan`, run `experiment`,
    stop the nodes. Exit code: the experiment's, or CLUSTER_FAILURE_EXIT, or 128 + signal."""
    os.environ["RAY_ADDRESS"] = settings.address  # for the experiment's ray.init(address="auto")
    settings.temp_dir.mkdir(parents=True, exist_ok=True)
    ray_nodes = RayNodes(settings, log_dir=settings.temp_dir)
    signals = SignalForwarder()
    try:
        log(f"starting Ray: head on {nodes[0].name} at {settings.address}, {len(nodes)} node(s) x "
            f"{settings.gpus_per_node} GPU(s), RAY_TMPDIR={settings.temp_dir}")
        ray_nodes.start_all(nodes, log=log)
        check_cluster(plan, timeout_s=check_timeout_s, log=log)
        ray.shutdown()
        log(f"running the experiment: {shlex.join(experiment)}")
        rc = signals.run(experiment, {**os.environ, "PYTHONUNBUFFERED": "1"})
        log(f"the experiment exited with status {rc}")
    except NodeStartError as exc:
        log(f"FAILED: {exc}")
        rc = CLUSTER_FAILURE_EXIT
    except ClusterCheckError as exc:
        log(f"FAILED: the cluster check found:\n{exc}")
        rc = CLUSTER_FAILURE_EXIT
    except Interrupted as exc:
        log(f"interrupted by {exc} before the experiment started")
        rc = 128 + exc.signum
    finally:
        signals.interruptible = False
        joined, started = list(ray_nodes.joined), len(ray_nodes.started)
        ray_nodes.stop()
        log(f"stopped the Ray processes this launch started ({started} node(s))")
        signals.restore()
    return SessionResult(rc, joined, signals.received, signals.forwarded)
