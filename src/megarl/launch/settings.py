"""What a launch is made of (nodes, ports, temp dir, options), with no Ray import: Ray reads its
auth settings once, when it is imported, so the launchers set them (`ray_process_env`) first.

Options come from the environment, so that `sbatch` passes them through (it exports the
submitting shell's environment):
  MEGARL_ENTRY            what Python runs as the experiment (default: -m megarl.trainer.main_ppo);
                          it gets the experiment arguments (--config FILE key=value ...)
  MEGARL_TMPDIR           where the per-cluster Ray temp dir goes, on every node (default /tmp)
  MEGARL_JOIN_TIMEOUT     seconds each Ray node has to join (default 180)
  MEGARL_CHECK_TIMEOUT    seconds for each step of the cluster check (default 180)
  MEGARL_RAY_WRAPPER      command prefix for `ray start` on every node, e.g. a container runner
  MEGARL_RAY_START_ARGS   extra `ray start` arguments for every node
The network interfaces the collectives use (`SOCKET_IFNAME_VARS`, e.g. NCCL_SOCKET_IFNAME=ib0)
are handed to every Ray node explicitly (`socket_env`), so every worker on it has them.
"""
from __future__ import annotations

import os
import secrets
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megarl.net import port_is_free

SLURM_NODE_LABEL = "slurm-node"
# Which interface NCCL, gloo and TensorPipe bind to (gloo takes a comma list, the same count on
# every rank); a cluster with several networks needs them the same in every process.
SOCKET_IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


def socket_env(environ=os.environ) -> dict[str, str]:
    """The socket interface variables set in `environ`, to pass on to every Ray node."""
    return {k: environ[k] for k in SOCKET_IFNAME_VARS if environ.get(k)}


@dataclass(frozen=True)
class LaunchOptions:
    entry: tuple[str, ...] = ("-m", "megarl.trainer.main_ppo")
    tmp_base: Path = Path("/tmp")
    join_timeout_s: float = 180.0
    check_timeout_s: float = 180.0
    ray_wrapper: tuple[str, ...] = ()
    ray_start_args: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env=os.environ) -> LaunchOptions:
        d = cls()
        return cls(
            entry=tuple(shlex.split(env["MEGARL_ENTRY"])) if env.get("MEGARL_ENTRY") else d.entry,
            tmp_base=Path(env.get("MEGARL_TMPDIR") or d.tmp_base),
            join_timeout_s=float(env.get("MEGARL_JOIN_TIMEOUT") or d.join_timeout_s),
            check_timeout_s=float(env.get("MEGARL_CHECK_TIMEOUT") or d.check_timeout_s),
            ray_wrapper=tuple(shlex.split(env.get("MEGARL_RAY_WRAPPER", ""))),
            ray_start_args=tuple(shlex.split(env.get("MEGARL_RAY_START_ARGS", ""))),
        )

    def experiment_command(self, experiment_args: list[str]) -> list[str]:
        return [sys.executable, *self.entry, *experiment_args]


@dataclass(frozen=True)
class NodeLaunch:
    """One Ray node to start: node `rank` of the plan, called `name`."""

    rank: int
    name: str
    prefix: tuple[str, ...] = ()  # runs the command on the node, e.g. ("srun", ..., "--nodelist=n2")
    labels: dict[str, str] = field(default_factory=dict)  # beyond the node-rank label
    env: dict[str, str] = field(default_factory=dict)  # e.g. CUDA_VISIBLE_DEVICES for local nodes


@dataclass(frozen=True)
class RaySettings:
    """What every node of one cluster shares."""

    head_ip: str
    port: int  # GCS
    client_port: int  # Ray client server (head only; its default 10001 collides between clusters)
    temp_dir: Path  # RAY_TMPDIR: short (Unix socket paths), one per cluster
    gpus_per_node: int
    cpus_per_node: int
    join_timeout_s: float = 180.0
    wrapper: tuple[str, ...] = ()  # command prefix for `ray start`, e.g. a container runner
    extra_args: tuple[str, ...] = ()  # appended to every `ray start`

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"


def ray_process_env(temp_dir: Path) -> dict[str, str]:
    """Environment for every process of one cluster (nodes, launcher, experiment): a private temp
    dir, and token auth with a fresh token. Ray 2.60 otherwise turns auth on by surprise, from
    ~/.ray/auth_token, for some processes and not others. Set it before importing Ray."""
    return {"RAY_TMPDIR": str(temp_dir), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}


def ports_for_job(job_id: int, is_free=port_is_free) -> tuple[int, int]:
    """(GCS port, client server port) for a Slurm job: derived from the job id so that jobs
    sharing a node differ, in 20000-27999 (above Ray's worker ports), moved on while taken."""
    port = 20000 + (job_id % 4000) * 2
    for _ in range(4000):
        if is_free(port) and is_free(port + 1):
            return port, port + 1
        port = 20000 + (port - 20000 + 2) % 8000
    raise RuntimeError("no free pair of ports in 20000-27999")


def log(message: str) -> None:
    """One line of the launcher's own output (the tests and users grep for this prefix)."""
    print(f"megarl launch: {message}", flush=True)
