"""Atomic checkpoints: complete ones only are resumed from, even when the writer is SIGKILLed at
any moment; pruning and re-saving never leave a half-deleted checkpoint that looks complete; the
controller state loads without unpickling arbitrary objects."""
import hashlib
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megarl import checkpoint
from megarl.config import ConfigError, ExperimentConfig

WRITER = Path(__file__).with_name("writer.py")


def config_for(root: Path, **trainer) -> ExperimentConfig:
    c = ExperimentConfig()
    c.trainer = replace(c.trainer, default_local_dir=str(root), project_name="p", experiment_name="e", **trainer)
    return c


def write(root: Path, step: int, keep=None, payload: bytes = b"weights") -> Path:
    tmp = checkpoint.begin(root, step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "payload.bin").write_bytes(payload)
    return checkpoint.commit(tmp, step, ExperimentConfig(), {"step": step, "rng": torch.get_rng_state()}, keep=keep)


def test_commit_makes_a_complete_checkpoint_and_moves_latest(tmp_path):
    root = tmp_path / "p" / "e"
    first = write(root, 1)
    assert first == root / "global_step_1" and (first / checkpoint.COMPLETE).is_file()
    assert (root / "latest").read_text().strip() == "global_step_1"
    write(root, 2)
    assert (root / "latest").read_text().strip() == "global_step_2"
    assert checkpoint.load_controller_state(root / "global_step_2")["step"] == 2
    assert not list(root.glob("*.tmp-*")) and not list(root.glob(".latest*"))


def test_resume_modes_pick_the_newest_complete_checkpoint_and_ignore_partial_ones(tmp_path):
    root = tmp_path / "p" / "e"
    write(root, 3)
    write(root, 5)
    checkpoint.begin(root, 7)  # a crash during the write of step 7
    (root / "global_step_9").mkdir()  # a directory without COMPLETE (e.g. copied by hand, half done)
    assert checkpoint.find_resume_dir(config_for(tmp_path)) == root / "global_step_5"
    assert checkpoint.find_resume_dir(config_for(tmp_path, resume_mode="disable")) is None
    chosen = config_for(tmp_path, resume_mode="resume_path", resume_from_path=str(root / "global_step_3"))
    assert checkpoint.find_resume_dir(chosen) == root / "global_step_3"
    partial = config_for(tmp_path, resume_mode="resume_path", resume_from_path=str(root / "global_step_9"))
    with pytest.raises(ConfigError, match="global_step_9: not a complete megarl checkpoint"):
        checkpoint.find_resume_dir(partial)


def test_export_finds_the_checkpoint_from_the_step_the_experiment_or_the_default_local_dir(tmp_path):
    """`megarl export DIR`: DIR may be a global_step_N, its experiment directory, or the
    trainer.default_local_dir a user set (<dir>/<project>/<experiment>/) holding one experiment;
    with several there, the error names each."""
    root = tmp_path / "p" / "e"
    write(root, 1)
    newest = write(root, 2)
    (tmp_path / "p" / "crashed").mkdir()  # an experiment without a complete checkpoint does not count
    checkpoint.begin(tmp_path / "p" / "crashed", 1)
    for given in (newest, root, tmp_path):
        assert checkpoint.resolve_checkpoint(given) == newest
    write(tmp_path / "q" / "other", 4)
    with pytest.raises(ConfigError, match=r"holds 2 experiments with complete checkpoints \(p/e, q/other\)"):
        checkpoint.resolve_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="nor a trainer.default_local_dir holding one experiment"):
        checkpoint.resolve_checkpoint(tmp_path / "p" / "crashed")


def test_pruning_keeps_the_newest_and_resaving_a_step_replaces_it(tmp_path):
    root = tmp_path / "p" / "e"
    for step in range(1, 5):
        write(root, step, keep=2)
    assert [s for s, _ in checkpoint.complete_checkpoints(root)] == [3, 4]
    write(root, 4, keep=2, payload=b"again")
    assert (root / "global_step_4" / "actor" / "payload.bin").read_bytes() == b"again"
    assert sorted(p.name for p in root.iterdir()) == ["global_step_3", "global_step_4", "latest"]


def test_controller_state_is_loaded_without_unpickling_arbitrary_objects(tmp_path):
    root = tmp_path / "p" / "e"
    directory = write(root, 1)
    torch.save({"step": 1, "hook": subprocess.Popen}, directory / "controller.pt")  # a global, not data
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.load_controller_state(directory)


def test_sigkill_at_random_moments_never_leaves_a_corrupt_checkpoint_to_resume_from(tmp_path):
    """A writer is killed 8 times at random moments (often mid-write, sometimes mid-prune); each
    time the checkpoint resume would pick is complete and consistent, and the next writer goes on
    from it. The writers are forked by one process (writer.py), so the imports are paid once."""
    root = tmp_path / "p" / "e"
    rng = random.Random(0)
    step, killed_mid_write = 1, 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    forker = subprocess.Popen([sys.executable, str(WRITER), str(root), "2"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(300, forker.kill)  # bounds the waits below
    watchdog.start()
    writer = None
    try:
        ready = forker.stdout.readline()  # printed after the imports
        assert ready.strip() == "ready", forker.stderr.read() if forker.poll() is not None else ready
        for _ in range(8):
            forker.stdin.write(f"{step}\n")
            forker.stdin.flush()
            writer = int(forker.stdout.readline())  # this writer's pid: it is writing from now on
            time.sleep(rng.uniform(0.05, 0.5))
            os.kill(writer, signal.SIGKILL)
            assert forker.stdout.readline().strip() == "reaped", forker.stderr.read()
            writer = None
            killed_mid_write += bool(list(root.glob("*.tmp-*")))
            resume = checkpoint.find_resume_dir(config_for(tmp_path))
            if resume is None:
                continue  # killed before the first checkpoint
            state = checkpoint.load_controller_state(resume)
            payload = (resume / "actor" / "payload.bin").read_bytes()
            assert hashlib.sha256(payload).hexdigest() == state["sha"], f"{resume} is inconsistent"
            assert (root / "latest").read_text().strip() in {p.name for _, p in checkpoint.complete_checkpoints(root)}
            step = state["step"] + 1
    finally:
        watchdog.cancel()
        if writer is not None:  # a failure above left it writing
            os.kill(writer, signal.SIGKILL)
        forker.communicate(timeout=30)  # closes its stdin: it ends
    assert forker.returncode == 0
    assert step > 5, "the writer never got far: the kills came too early to test anything"
    assert killed_mid_write >= 1, "no kill landed during a checkpoint write"


def test_torch_dist_metadata_naming_code_is_refused_before_it_is_unpickled(tmp_path):
    """torch.distributed.checkpoint unpickles `.metadata` without restriction: megarl checks it
    first, allowing only the classes checkpoint metadata is made of."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    from megarl.bridge import ConversionError
    from megarl.bridge.torch_dist_io import check_metadata_is_data

    good = tmp_path / "good"
    save({"w": torch.ones(2, 3, dtype=torch.bfloat16), "step": 3}, storage_writer=FileSystemWriter(good))
    check_metadata_is_data(good)

    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(ConversionError, match=r"bad/\.metadata: refers to posix\.system"):
        check_metadata_is_data(bad)


def verl_sft_resume_path(resume_mode: str, resume_from_path):
    """verl 0.9.1's SFT choice of checkpoint (utils/checkpoint/checkpoint_handler.py
    CheckpointHandler._determine_resume_path, run from its wheel), "LATEST" standing for its newest one."""
    import ast
    import types
    import zipfile

    wheel = Path(os.environ.get("MEGARL_VERL_WHEEL") or Path(__file__).resolve().parents[2] / ".verl-oracle" /
                 "verl-0.9.1-py3-none-any.whl")
    if not wheel.is_file():
        pytest.fail(f"verl 0.9.1's wheel is not at {wheel}: run `make install-verl-oracle` (or set MEGARL_VERL_WHEEL)")
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read("verl/utils/checkpoint/checkpoint_handler.py").decode())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointHandler"]
    (method,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "_determine_resume_path"]
    namespace = {"os": os}
    exec(compile(ast.Module(body=[method], type_ignores=[]), "checkpoint_handler.py", "exec"), namespace)
    handler = types.SimpleNamespace(resume_mode=resume_mode, resume_from_path=resume_from_path,
                                    _find_latest_checkpoint=lambda: "LATEST")
    return namespace["_determine_resume_path"](handler)


@pytest.mark.parametrize("mode, given", [("auto", None), ("auto", 3), ("resume_path", 3), ("disable", None),
                                         ("disable", 3)])
def test_sft_resumes_from_the_checkpoint_verls_sft_trainer_picks(tmp_path, mode, given):
    from megarl.trainer.offline import resume_dir

    root = tmp_path / "p" / "e"
    write(root, 3)
    write(root, 5)
    path = str(root / f"global_step_{given}") if given else None
    expected = verl_sft_resume_path(mode, path)
    expected = root / "global_step_5" if expected == "LATEST" else expected and Path(expected)
    assert resume_dir(config_for(tmp_path, resume_mode=mode, resume_from_path=path)) == expected
