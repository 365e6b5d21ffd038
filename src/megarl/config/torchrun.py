"""verl's SFT scripts launch `torchrun --nnodes=N --nproc_per_node=G -m verl.trainer.sft_trainer ...`: verl's
SFT trainer is one torch process per GPU and takes its layout from torchrun. megarl's offline trainers are one
driver that places its workers through Ray on `trainer.nnodes` x `trainer.n_gpus_per_node` GPUs. This module
reads torchrun's layout, from its command line (the corpus of verl's scripts) or from the environment torchrun
gives each process, and says it as those two keys.

torchrun's rules (PyTorch, torch/distributed/run.py and the "torchrun (Elastic Launch)" docs): `--nnodes` is N
or an elastic range MIN:MAX; `--nproc-per-node` (also spelt `--nproc_per_node`) a count or auto/cpu/gpu/xpu;
each process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (= nproc per node) and TORCHELASTIC_RUN_ID.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from megarl.config.errors import ConfigError

# the variables torchrun sets in each process it starts (torch/distributed/elastic/agent/server/api.py
# `_assign_worker_ranks` and local_elastic_agent.py `_start_workers`): megarl's driver drops them before Ray starts
TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunLayout:
    nnodes: int
    nproc_per_node: int
    rank: int = 0  # this process's global rank (0 from a command line)

    def overrides(self) -> list[str]:
        """The layout as megarl's keys: the GPUs megarl's driver places its workers on."""
        return [f"trainer.nnodes={self.nnodes}", f"trainer.n_gpus_per_node={self.nproc_per_node}"]


def _count(flag: str, value: str, what: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"torchrun {flag}={value}: megarl needs a fixed {what} (a positive integer) to place its "
                          f"workers on trainer.nnodes x trainer.n_gpus_per_node GPUs; give it as a number")
    return int(value)


def layout_from_args(args: list[str]) -> TorchrunLayout:
    """torchrun's layout from its arguments before `-m` (`--nnodes=2`, `--nnodes 2`, `--nproc-per-node=8`,
    `--nproc_per_node 8`; torchrun's defaults: 1 node, 1 process). An elastic range or `auto` is refused."""
    values = {"--nnodes": "1", "--nproc-per-node": "1"}
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        flag = flag.replace("_", "-") if flag.startswith("--nproc") else flag
        if flag in values:
            if not eq:
                i += 1
                value = args[i] if i < len(args) else ""
            values[flag] = value
        i += 1
    return TorchrunLayout(_count("--nnodes", values["--nnodes"], "number of nodes"),
                          _count("--nproc-per-node", values["--nproc-per-node"], "number of processes per node"))


def layout_from_env(env: Mapping[str, str]) -> Optional[TorchrunLayout]:
    """The layout torchrun started this process in, or None outside torchrun (no TORCHELASTIC_RUN_ID)."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    return TorchrunLayout(world // local, local, int(env["RANK"]))


def multi_node_problem(layout: TorchrunLayout, prog: str) -> Optional[str]:
    """Why megarl's driver cannot run under this torchrun, or None: over several nodes each node's rank 0
    would start a driver, while megarl runs one driver that reaches every node through one Ray cluster."""
    if layout.nnodes == 1:
        return None
    return (f"{prog} under torchrun on {layout.nnodes} nodes: megarl runs one driver that places its workers "
            "through a Ray cluster spanning the nodes, not one process per GPU; start Ray over the nodes "
            f"(`megarl submit`, slurm/megarl.sbatch) and run `python -m {prog.split()[-1]} "
            f"trainer.nnodes={layout.nnodes} trainer.n_gpus_per_node={layout.nproc_per_node} ...` once, from one node")
