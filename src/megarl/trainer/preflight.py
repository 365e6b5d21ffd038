"""Checks of the machine against a validated config, before any worker starts.

Static checks live in megarl.config.validate (they pass on any machine, so a config can be
validated on a laptop); these look at files and devices, and name the key to fix.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from megarl.config import ConfigError, ExperimentConfig
from megarl.config.devices import Devices, devices_from_config


def _is_local_hf_checkpoint(path: str) -> bool:
    return (Path(path) / "config.json").is_file()


def check_environment(config: ExperimentConfig) -> None:
    """Raise ConfigError listing every missing file or device the run would need."""
    problems = []
    for key, files in (("data.train_files", config.data.train_files), ("data.val_files", config.data.val_files)):
        for f in files:
            if not Path(f).is_file():
                problems.append(f"{key}: file not found: {f}")
    model = config.actor_rollout_ref.model.path
    if model and not _is_local_hf_checkpoint(model):
        problems.append(
            f"actor_rollout_ref.model.path={model!r}: not a local HF checkpoint directory (no config.json there). "
            "Download it first (e.g. huggingface-cli download <id> --local-dir DIR) and pass the directory"
        )
    rm = config.reward_model
    if rm.enable and rm.model.path:
        if not _is_local_hf_checkpoint(rm.model.path):
            problems.append(f"reward_model.model.path={rm.model.path!r}: not a local HF checkpoint directory "
                            "(no config.json there)")
        else:
            from megarl.engines.megatron.reward_model import check_tokenizer

            try:
                check_tokenizer(config)
            except NotImplementedError as error:
                problems.append(str(error))
    reward_fn = config.custom_reward_function.path
    if reward_fn and not Path(reward_fn).is_file():
        problems.append(f"custom_reward_function.path: file not found: {reward_fn}")

    try:
        resolve_devices(config)
    except ConfigError as problem:
        problems.append(str(problem))
    if config.actor_rollout_ref.rollout.name == "sglang":
        import torch

        if not torch.cuda.is_available():
            problems.append("actor_rollout_ref.rollout.name=sglang needs a CUDA GPU, and this machine has no CUDA GPU; "
                            "on CPU use trainer.device=cpu actor_rollout_ref.rollout.name=cpu")
        elif importlib.util.find_spec("sglang") is None:
            problems.append("actor_rollout_ref.rollout.name=sglang: sglang is not installed (pip install -e .[gpu])")
    if problems:
        raise ConfigError("this machine cannot run the experiment:\n" + "\n".join(f"  - {p}" for p in problems))


def resolve_devices(config: ExperimentConfig) -> Devices:
    """The device, backends, weight-sync transport and NCCL environment of this run, decided on this
    (the controller's) machine: `trainer.device=auto` means CUDA where the controller sees a GPU."""
    import torch  # deferred: imported only when a run really starts

    return devices_from_config(config, torch.cuda.is_available())
