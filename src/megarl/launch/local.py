"""`python -m megarl.launch.local --config FILE.yaml [key=value ...]`, run by launch/local.sh: a Ray
cluster on this machine sized from the config (a head, plus trainer.nnodes - 1 more Ray nodes when
the config spans several nodes, to try a multi-node layout on one machine), the cluster check, the
experiment; then exactly the Ray processes it started are stopped. Exits with the experiment's
status.

Node k gets GPUs k x n_gpus_per_node ... of CUDA_VISIBLE_DEVICES (default 0, 1, ...), so on a GPU
machine the simulated nodes do not share GPUs; without GPUs they are Ray's logical GPUs.
Settings: see megarl.launch.session (MEGARL_*).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from megarl.config import ConfigError, load_and_validate
from megarl.config.args import add_experiment_args, entry_point
from megarl.launch.settings import (
    LaunchOptions,
    NodeLaunch,
    RaySettings,
    log,
    ray_process_env,
)
from megarl.net import free_port
from megarl.placement import format_gpu_map, plan_from_config


def gpu_ids_per_node(nnodes: int, gpus_per_node: int, visible: str | None) -> list[list[str]]:
    """Split CUDA_VISIBLE_DEVICES (or 0..N-1) into one list of GPU ids per simulated node."""
    ids = visible.split(",") if visible else [str(i) for i in range(nnodes * gpus_per_node)]
    if len(ids) < nnodes * gpus_per_node:
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={visible} lists {len(ids)} GPU(s) but trainer.nnodes x "
                          f"trainer.n_gpus_per_node = {nnodes} x {gpus_per_node}")
    return [ids[k * gpus_per_node:(k + 1) * gpus_per_node] for k in range(nnodes)]


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/local.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_experiment_args(parser)
    experiment_args = list(sys.argv[1:] if argv is None else argv)  # passed on unchanged
    args = parser.parse_intermixed_args(experiment_args)
    config = load_and_validate(args.config, args.overrides)
    nnodes, gpus = config.trainer.nnodes, config.trainer.n_gpus_per_node
    gpu_ids = gpu_ids_per_node(nnodes, gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    plan = plan_from_config(config)
    log(f"placement plan:\n{format_gpu_map(plan)}")

    opts = LaunchOptions.from_env()
    temp_dir = opts.tmp_base / f"megarl-local-{os.getpid()}"
    os.environ.update(ray_process_env(temp_dir))
    import ray.util  # only now: Ray reads its auth settings when imported

    from megarl.launch.session import run_session

    port = free_port("")  # Ray's GCS and client server: reached from every node
    settings = RaySettings(
        head_ip=ray.util.get_node_ip_address(), port=port, client_port=free_port("", avoid=(port,)),
        temp_dir=temp_dir, gpus_per_node=gpus,
        cpus_per_node=max(1, (os.cpu_count() or 1) // nnodes), join_timeout_s=opts.join_timeout_s,
        wrapper=opts.ray_wrapper, extra_args=opts.ray_start_args)
    nodes = [NodeLaunch(k, f"node{k}", env={"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids[k])}) for k in range(nnodes)]
    try:
        result = run_session(plan, nodes, settings, opts.experiment_command(experiment_args),
                             check_timeout_s=opts.check_timeout_s, log=log)
    finally:
        shutil.rmtree(settings.temp_dir, ignore_errors=True)
    log(f"exit status {result.exit_code}")
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
