"""`python -m megarl.launch.slurm --config FILE.yaml [key=value ...]`, run by slurm/megarl.sbatch
inside the allocation: Ray head on this (the batch) node, one Ray worker per other node through
`srun`, the cluster check, the experiment, Ray stopped on every node; exits with the experiment's
status. On SIGUSR1 (sbatch --signal=B:USR1@N before the time limit, or a preemption notice) the
experiment is asked to checkpoint and stop, and the job is requeued if it was submitted with
--requeue. Settings: see megarl.launch.session (MEGARL_*), plus MEGARL_HEAD_IP to choose the
head's address (default: the address Ray picks for this node).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from megarl.config import ConfigError, load_and_validate
from megarl.config.args import add_experiment_args, entry_point
from megarl.launch.settings import (
    SLURM_NODE_LABEL,
    LaunchOptions,
    NodeLaunch,
    RaySettings,
    log,
    ports_for_job,
    ray_process_env,
    socket_env,
)
from megarl.placement import format_gpu_map, plan_from_config


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    nodes: tuple[str, ...]  # the batch node first, then the others in Slurm's order
    gpus_per_node: int
    cpus_per_node: int

    @classmethod
    def from_env(cls, env=os.environ) -> SlurmJob:
        missing = [k for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURMD_NODENAME") if not env.get(k)]
        if missing:
            raise ConfigError(f"not inside a Slurm job ({', '.join(missing)} unset): submit slurm/megarl.sbatch "
                              "with sbatch, or use launch/local.sh on one machine")
        names = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], check=True,
                               capture_output=True, text=True).stdout.split()
        head = env["SLURMD_NODENAME"]
        return cls(int(env["SLURM_JOB_ID"]), (head, *[n for n in names if n != head]),
                   int(env.get("SLURM_GPUS_ON_NODE") or 0), int(env.get("SLURM_CPUS_ON_NODE") or 1))


def allocation_problems(job: SlurmJob, nnodes: int, gpus_per_node: int) -> list[str]:
    """Where the allocation differs from trainer.nnodes x trainer.n_gpus_per_node."""
    problems = []
    if len(job.nodes) != nnodes:
        problems.append(f"the job has {len(job.nodes)} node(s) ({','.join(job.nodes)}) but trainer.nnodes={nnodes}: "
                        f"submit with --nodes={nnodes}")
    if job.gpus_per_node != gpus_per_node:
        problems.append(f"the job has {job.gpus_per_node} GPU(s) per node but trainer.n_gpus_per_node={gpus_per_node}: "
                        f"submit with --gpus-per-node={gpus_per_node} (with --exclusive, as in slurm/megarl.sbatch, "
                        "a job gets every GPU of its nodes)")
    return problems


def srun_step(nodes: list[str], cpus_per_task: int, gpus_per_node: int) -> tuple[str, ...]:
    """A job step on `nodes`, one task each, sharing the job's resources with the other steps
    (`--overlap`), asking for what the task needs explicitly (man srun, Slurm 22.05):
    - `--cpus-per-task`: "the number of cpus per task specified for salloc or sbatch is not
      automatically inherited by srun"; without it a Ray node would be confined to one CPU.
    - `--gres=gpu:N`: "allocated to the job on each node", N GPUs per node for the step's one task
      per node (nemo's ray.sub and AReaL ask the same way; `--gpus-per-task` would also imply a
      `--gpu-bind`). A step defaults to the job's GRES "except those implicitly requested when a
      job is exclusive": explicit is certain. None asked when `gpus_per_node` is 0.
    - `--export=ALL`: every variable of the launcher (Ray's settings, the socket interfaces) reaches
      the task, even where the job's environment says otherwise (`sbatch --export=NONE` sets
      SLURM_EXPORT_ENV=NONE for its steps; the option wins over the variable)."""
    step = ["srun", "--overlap", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(nodes)}", f"--cpus-per-task={max(1, cpus_per_task)}", "--export=ALL"]
    if gpus_per_node > 0:
        step.append(f"--gres=gpu:{gpus_per_node}")
    return tuple(step)


def _requeueable(job_id: int) -> bool:
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True).stdout
    return "Requeue=1" in out.split()


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.launch.slurm", description=__doc__)
    add_experiment_args(parser)
    experiment_args = list(sys.argv[1:] if argv is None else argv)  # passed on unchanged
    args = parser.parse_intermixed_args(experiment_args)
    job = SlurmJob.from_env()
    config = load_and_validate(args.config, args.overrides)
    problems = allocation_problems(job, config.trainer.nnodes, config.trainer.n_gpus_per_node)
    if problems:
        raise ConfigError("the Slurm allocation does not match the config:\n" + "\n".join(f"  - {p}" for p in problems))
    plan = plan_from_config(config, node_names=job.nodes)
    log(f"job {job.job_id} on {','.join(job.nodes)}; placement plan:\n{format_gpu_map(plan)}")

    opts = LaunchOptions.from_env()
    temp_dir = opts.tmp_base / f"megarl-{job.job_id}"
    os.environ.update(ray_process_env(temp_dir))  # srun passes it on to every node
    import ray.util  # only now: Ray reads its auth settings when imported

    from megarl.launch.session import run_session

    port, client_port = ports_for_job(job.job_id)
    settings = RaySettings(
        head_ip=os.environ.get("MEGARL_HEAD_IP") or ray.util.get_node_ip_address(), port=port,
        client_port=client_port, temp_dir=temp_dir, gpus_per_node=job.gpus_per_node,
        cpus_per_node=job.cpus_per_node, join_timeout_s=opts.join_timeout_s, wrapper=opts.ray_wrapper,
        extra_args=opts.ray_start_args)
    nodes = [NodeLaunch(rank, name, prefix=srun_step([name], job.cpus_per_node, job.gpus_per_node),
                        labels={SLURM_NODE_LABEL: name}, env=socket_env())
             for rank, name in enumerate(job.nodes)]
    result = run_session(plan, nodes, settings, opts.experiment_command(experiment_args),
                         check_timeout_s=opts.check_timeout_s, log=log)

    shutil.rmtree(settings.temp_dir, ignore_errors=True)  # here, on the head node
    others = [n.name for n in result.joined if n.rank > 0]  # the temp dir exists where Ray started
    if others:
        try:
            subprocess.run([*srun_step(others, 1, 0), "rm", "-rf", str(settings.temp_dir)], timeout=60,
                           stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            log(f"could not remove {settings.temp_dir} on {','.join(others)} within 60 s")
    if signal.SIGUSR1 in result.experiment_signals:
        if _requeueable(job.job_id):
            log(f"requeueing job {job.job_id}: it will resume from its last checkpoint")
            subprocess.run(["scontrol", "requeue", str(job.job_id)], check=False)
        else:
            log("not requeueing: the job is not requeueable (submit it with --requeue)")
    elif signal.SIGUSR1 in result.signals:
        log("not requeueing: SIGUSR1 came before the experiment started, so no checkpoint was written "
            "(is the lead time of #SBATCH --signal longer than the time limit?)")
    log(f"exit status {result.exit_code}")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
