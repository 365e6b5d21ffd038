"""The run's devices, decided once on the controller's machine before any worker starts: the
device, the backends, the weight-sync transport and the workers' environment
(`megarl.config.devices` holds the pure rules; this module gathers the facts they need)."""
from __future__ import annotations

import os
import sys

from megarl.config import ConfigError, ExperimentConfig
from megarl.config.devices import Devices, auto_device_refusal, devices_from_config


def resolve_devices(config: ExperimentConfig) -> Devices:
    """The device, backends, weight-sync transport and NCCL environment of this run, decided on this
    (the controller's) machine: `trainer.device=auto` means CUDA where the controller sees a GPU, and
    is refused where it does not but the job has GPUs (`config.devices.auto_device_refusal`: the
    facts are gathered here, from torch, this process's environment and the Ray cluster joined)."""
    import torch  # deferred: imported only when a run really starts

    cuda = torch.cuda.is_available()
    problem = auto_device_refusal(config.trainer.device, cuda, joined_cluster_gpus(), os.environ)
    if problem:
        raise ConfigError(problem)
    return devices_from_config(config, cuda)


def joined_cluster_gpus() -> float | None:
    """The GPUs the Ray cluster this process joined advertises (`ray.cluster_resources()`); None when
    it joined none: Ray is not connected (before the run starts it), or it is connected to a cluster
    without RAY_ADDRESS, which `runtime.cluster.connect_ray` starts here with the config's logical
    GPUs (they say nothing about real ones). Ray is not imported here: only read if already connected."""
    ray = sys.modules.get("ray")
    if ray is None or not os.environ.get("RAY_ADDRESS") or not ray.is_initialized():
        return None
    return float(ray.cluster_resources().get("GPU", 0))
