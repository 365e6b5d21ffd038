"""Atomic experiment checkpoints and resume.

Layout under `<trainer.default_local_dir>/<project>/<experiment>/`:

    global_step_N/
        actor/            the actor engine's model + optimizer + scheduler (dist_checkpointing); the
                          model alone where actor_rollout_ref.actor.checkpoint.save_contents has no optimizer
        actor_hf/         an HF copy of the actor, where save_contents has hf_model
        critic/           the critic's, when there is one
        controller.pt     step, sampler, KL controller, RNG states
        config.yaml       the resolved config of the run
        COMPLETE          written last, inside the directory, before the rename
    latest                text file: the name of the newest complete checkpoint

A checkpoint is written under `global_step_N.tmp-<pid>` and renamed when everything in it is on
disk (fsynced); `latest` is replaced atomically afterwards. A directory without COMPLETE, or a
leftover `.tmp-*` directory, is never resumed from. `max_actor_ckpt_to_keep` prunes the oldest
complete checkpoints once the new one is complete.

With `actor_rollout_ref.actor.checkpoint.async_save` (`Checkpoints`) the actor's tensors are staged
and written in the background while training goes on; the checkpoint is committed (the HF copy, the
controller state taken at the save, COMPLETE, the rename, `latest`, the pruning) only once every
rank's write finished: checked at each step boundary, waited for before the next save, at the end
of the run and on preemption. Until then, and after a crash, `latest` names the previous one.
"""
from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import yaml

from megarl.config import ConfigError, ExperimentConfig, to_yaml

STEP_DIR = re.compile(r"^global_step_(\d+)$")
COMPLETE = "COMPLETE"
LATEST = "latest"

log = logging.getLogger("megarl.checkpoint")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = STEP_DIR.match(child.name)
        if match and (child / COMPLETE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def begin(root: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint of `step`."""
    tmp = root / f"global_step_{step}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, step: int, config: ExperimentConfig, controller_state: dict,
           keep: Optional[int] = None) -> Path:
    """Write the controller state and config into `tmp`, fsync, rename to global_step_N, point
    `latest` at it, then prune to the newest `keep` checkpoints."""
    torch.save(controller_state, tmp / "controller.pt")
    (tmp / "config.yaml").write_text(to_yaml(config))
    (tmp / COMPLETE).write_text(f"{step}\n")
    _fsync_tree(tmp)
    root = tmp.parent
    final = root / f"global_step_{step}"
    replaced = None
    if final.exists():  # re-saving the same step (e.g. after a resume): set the old one aside first
        replaced = root / f"global_step_{step}.old-{os.getpid()}"
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / f".{LATEST}.tmp-{os.getpid()}"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    if replaced is not None:
        remove(replaced)
    if keep:
        for _, old in complete_checkpoints(root)[:-keep]:
            remove(old)
    return final


def remove(directory: Path) -> None:
    """Delete a checkpoint so that no crash midway leaves something that looks complete:
    COMPLETE goes first (and is synced), then the rest."""
    marker = directory / COMPLETE
    if marker.exists():
        marker.unlink()
        _fsync_dir(directory)
    shutil.rmtree(directory)


def find_resume_dir(config: ExperimentConfig) -> Optional[Path]:
    """The checkpoint to resume from per `trainer.resume_mode`, or None to start fresh."""
    t = config.trainer
    root = Path(t.default_local_dir) / t.project_name / t.experiment_name
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        path = Path(t.resume_from_path)
        if not (path / COMPLETE).is_file():
            raise ConfigError(f"trainer.resume_from_path={t.resume_from_path}: not a complete megarl checkpoint "
                              f"(no {COMPLETE} file in it)")
        return path
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete `global_step_N` directory, given it, its experiment directory (then the newest
    complete one), or the `trainer.default_local_dir` above (`<dir>/<project>/<experiment>/`) when
    it holds exactly one experiment with a complete checkpoint; with several, the error names them."""
    path = Path(path)
    if (path / COMPLETE).is_file():
        return path
    done = complete_checkpoints(path)
    if done:
        return done[-1][1]
    experiments = sorted(e for e in path.glob("*/*") if e.is_dir() and complete_checkpoints(e)) if path.is_dir() else []
    if len(experiments) == 1:
        return complete_checkpoints(experiments[0])[-1][1]
    if experiments:
        found = ", ".join(str(e.relative_to(path)) for e in experiments)
        raise ConfigError(f"{path}: holds {len(experiments)} experiments with complete checkpoints ({found}); "
                          f"name one of them, e.g. {experiments[0]}")
    raise ConfigError(f"{path}: neither a complete megarl checkpoint (global_step_N with {COMPLETE}), an "
                      "experiment directory holding one, nor a trainer.default_local_dir holding one experiment")


def saves_optimizer(config: ExperimentConfig) -> bool:
    """Whether the actor's checkpoints hold its optimizer (verl's save_contents `optimizer`)."""
    return "optimizer" in config.actor_rollout_ref.actor.checkpoint.save_contents


def saved_optimizer(directory: Path, role: str = "actor") -> bool:
    """Whether the checkpoint `directory` holds `role`'s (actor or critic) optimizer: its run's
    save_contents (its config.yaml); a checkpoint of before save_contents does."""
    tree = yaml.safe_load((directory / "config.yaml").read_text()) or {}
    section = tree.get("actor_rollout_ref", {}).get("actor", {}) if role == "actor" else tree.get(role, {})
    contents = section.get("checkpoint", {}).get("save_contents")
    return contents is None or "optimizer" in contents


def loads_optimizer(config: ExperimentConfig, directory: Path, role: str = "actor") -> bool:
    """Whether resuming from `directory` loads `role`'s optimizer, per its `checkpoint.load_contents`
    (verl: CheckpointManager.should_load_optimizer): None loads what the checkpoint holds; a list
    naming optimizer where the checkpoint holds none is refused, as verl's load fails then
    (megatron_checkpoint_manager.py load_checkpoint: no optimizer state in the checkpoint)."""
    contents = (config.actor_rollout_ref.actor if role == "actor" else config.critic).checkpoint.load_contents
    saved = saved_optimizer(directory, role)
    if contents is None:
        return saved
    if "optimizer" in contents and not saved:
        key = "actor_rollout_ref.actor" if role == "actor" else role
        raise ConfigError(f"{key}.checkpoint.load_contents={contents}: {directory} holds no {role} optimizer (its "
                          "run's save_contents had none); drop optimizer from load_contents to start a fresh one")
    return "optimizer" in contents


def write_actor_parts(tmp: Path, config: ExperimentConfig, actor) -> None:
    """The actor's parts of the checkpoint being written in `tmp` (from `begin`) per its save_contents:
    the engine's state under `actor/` (`actor`: its role handle), then the HF copy `actor_hf/` where
    hf_model is asked for."""
    actor.save_checkpoint(str(tmp / "actor"), saves_optimizer(config))
    _write_hf_copy(tmp, config)


def _write_hf_copy(tmp: Path, config: ExperimentConfig) -> None:
    """`actor_hf/` from the written `actor/` where save_contents has hf_model."""
    if "hf_model" in config.actor_rollout_ref.actor.checkpoint.save_contents:
        _write_hf(tmp / "actor", tmp / "actor_hf", config)


@dataclass
class _Pending:
    """A checkpoint whose actor is being written in the background."""

    tmp: Path
    step: int
    controller_state: dict  # a deep copy taken at the save: the state of the same step as the weights
    started: float  # time.monotonic() at the save


class Checkpoints:
    """The checkpoints of a run's actor (and critic), committed atomically (`commit`). With a role's
    `checkpoint.async_save` (actor_rollout_ref.actor's, critic's) its write goes on in the background
    (MegatronEngine.save_checkpoint(background=True)) and the checkpoint is committed once every
    rank of every role finished writing: `poll` at each step boundary, `finish` (waiting at most
    actor_rollout_ref.nccl_timeout seconds) before the next save, at the end and on preemption.
    A role saving synchronously has its part on disk when `save` returns."""

    def __init__(self, config: ExperimentConfig, actor, critic=None):
        self.config, self.actor, self.critic = config, actor, critic
        self.background = config.actor_rollout_ref.actor.checkpoint.async_save
        self.critic_background = critic is not None and config.critic.checkpoint.async_save
        self.timeout_s = float(config.actor_rollout_ref.nccl_timeout)
        self.pending: Optional[_Pending] = None
        self.latest: Optional[Path] = None  # the newest checkpoint this run committed

    def save(self, root: Path, step: int, controller_state: dict) -> Optional[Path]:
        """Write the checkpoint of `step` under `root` (the previous background write finished and
        committed first); returns its directory once committed, or None while its write goes on."""
        self.finish()
        tmp = begin(root, step)
        self.actor.save_checkpoint(str(tmp / "actor"), saves_optimizer(self.config), self.background)
        if self.critic is not None:
            self.critic.save_checkpoint(str(tmp / "critic"), "optimizer" in self.config.critic.checkpoint.save_contents,
                                        self.critic_background)
        pending = _Pending(tmp, step, copy.deepcopy(controller_state), time.monotonic())
        if not (self.background or self.critic_background):
            return self._commit(pending)
        self.pending = pending
        return None

    def poll(self) -> Optional[Path]:
        """At a step boundary: commit the pending checkpoint if every rank's write finished (one
        collective over the actor's ranks); returns its directory, or None. A write that failed
        raises here, and its checkpoint is dropped, never committed."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        if not self._writes_finished(blocking=False):
            self.pending = pending
            return None
        return self._commit(pending)

    def _writes_finished(self, blocking: bool) -> bool:
        """Whether every role's background write finished (`MegatronEngine.finish_saves` on each role,
        a collective over its ranks: called on both whatever the other answers)."""
        roles = [self.actor] + ([self.critic] if self.critic is not None else [])
        return all([role.finish_saves(blocking=blocking, timeout_s=self.timeout_s) for role in roles])

    def finish(self) -> Optional[Path]:
        """Wait for the pending write (at most `timeout_s`, then TimeoutError) and commit it;
        returns the newest checkpoint this run committed (None: none yet). A write that failed or
        timed out raises here, and its checkpoint is dropped, never committed."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._writes_finished(blocking=True)
            self._commit(pending)
        return self.latest

    def _commit(self, pending: _Pending) -> Path:
        _write_hf_copy(pending.tmp, self.config)
        self.latest = commit(pending.tmp, pending.step, self.config, pending.controller_state,
                             keep=self.config.trainer.max_actor_ckpt_to_keep)
        log.info("checkpoint of step %d saved to %s (%.1f s)", pending.step, self.latest,
                 time.monotonic() - pending.started)
        return self.latest


def _write_hf(actor_dir: Path, out: Path, config: ExperimentConfig, on_progress=None) -> None:
    from megarl.bridge.convert import convert_torch_dist_to_hf

    lora = config.actor_rollout_ref.model.lora
    convert_torch_dist_to_hf(actor_dir, out, config.actor_rollout_ref.model.path,
                             on_progress=on_progress, lora_scale=lora.alpha / lora.rank if lora.rank > 0 else None)


def export_hf(checkpoint_dir: str | Path, out: Optional[str | Path] = None, on_progress=None) -> Path:
    """Write the actor of a checkpoint as an HF checkpoint (safetensors, config and tokenizer of the
    run's `actor_rollout_ref.model.path`), loadable by transformers and SGLang. `out` defaults to
    `<checkpoint>/actor_hf`. Returns the output directory."""
    from megarl.config import load_config

    directory = resolve_checkpoint(checkpoint_dir)
    config = load_config(directory / "config.yaml")
    out = Path(out) if out is not None else directory / "actor_hf"
    _write_hf(directory / "actor", out, config, on_progress)
    return out


def export_lora(checkpoint_dir: str | Path, out: Optional[str | Path] = None) -> Path:
    """Write the actor's LoRA adapters of a checkpoint as a PEFT adapter (`adapter_config.json`,
    `adapter_model.safetensors`) for the run's base model; `out` defaults to `<checkpoint>/actor_lora`."""
    from megarl.bridge.lora import read_adapters, write_peft_adapter
    from megarl.bridge.torch_dist_io import TorchDistReader
    from megarl.config import load_config

    directory = resolve_checkpoint(checkpoint_dir)
    config = load_config(directory / "config.yaml")
    lora = config.actor_rollout_ref.model.lora
    if lora.rank <= 0:
        raise ConfigError(f"{directory}: the run trained full weights (actor_rollout_ref.model.lora.rank=0), "
                          "it has no adapter to export; use megarl export without --lora")
    out = Path(out) if out is not None else directory / "actor_lora"
    adapters = read_adapters(TorchDistReader(directory / "actor"))
    return write_peft_adapter(adapters, out, lora.rank, lora.alpha, config.actor_rollout_ref.model.path)


def load_controller_state(directory: Path) -> dict:
    """The controller's state: plain containers and tensors only (`weights_only` loading)."""
    return torch.load(directory / "controller.pt", weights_only=True)
