"""What a GPU user installs says the truth: setup.py's pins, the lock files of the tested lines
(requirements/gpu-py3*.lock, written by `make lock`), `megarl doctor`'s tested range and
docker/Dockerfile agree with each other and with megatron-core's own metadata."""
import ast
import importlib.metadata as metadata
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from megarl.launch import doctor

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {"3.11": ROOT / "requirements" / "gpu-py311.lock", "3.12": ROOT / "requirements" / "gpu-py312.lock"}
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def setup_py() -> dict:
    """The literal lists (CORE, GPU, TEST) and python_requires of setup.py, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
            found[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "python_requires":
            found["python_requires"] = ast.literal_eval(node.value)
    return found


def read_lock(path: Path) -> dict:
    """{canonical name: version} of a lock file's `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


@pytest.mark.parametrize("python", sorted(LOCKS))
def test_every_setup_py_requirement_admits_the_locked_version(python):
    lock = read_lock(LOCKS[python])
    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    checked = 0
    for line in setup_py()["CORE"] + setup_py()["GPU"]:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} (setup.py) is missing from {LOCKS[python].name}"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"setup.py asks {line!r}, {LOCKS[python].name} has {lock[name]}"
        checked += 1
    assert checked >= 20
    for line in setup_py()["GPU"]:  # the extras' own requirements are in the lock too (resolved, not just named)
        for extra in Requirement(line).extras:
            if extra == "pytorch":
                assert "transformer-engine-torch" in lock
            if extra == "core-cu13" or extra == "core_cu13":
                assert "transformer-engine-cu13" in lock


def test_the_locks_are_the_tested_lines():
    assert read_lock(LOCKS["3.11"])["megatron-core"] == "0.16.1"
    assert read_lock(LOCKS["3.12"])["megatron-core"].startswith("0.19.")
    requires = SpecifierSet(setup_py()["python_requires"])
    for python in LOCKS:
        assert requires.contains(f"{python}.0") and python in doctor.TESTED_PYTHONS
        assert f"resolved for Python {python}," in LOCKS[python].read_text()
    assert set(doctor.TESTED_PYTHONS) == set(LOCKS)
    assert not requires.contains("3.10.0")  # SGLang 0.5.23 has no cp310 wheel


def test_doctor_and_setup_py_tested_megatron_core_ranges_are_equal():
    (line,) = [r for r in setup_py()["CORE"] if Requirement(r).name == "megatron-core"]
    assert Requirement(line).specifier == doctor.MEGATRON_CORE_TESTED
    for python, lock in LOCKS.items():
        assert read_lock(lock)["megatron-core"] in doctor.MEGATRON_CORE_TESTED


def test_this_interpreter_runs_its_lines_megatron_core_and_its_te_pin_is_one_megatron_core_accepts():
    python = ".".join(platform.python_version().split(".")[:2])
    lock = read_lock(LOCKS[python])
    assert metadata.version("megatron-core") == lock["megatron-core"]  # CI tests the locked version
    # megatron-core's own metadata is the authority on the transformer-engine it accepts
    allowed = doctor.transformer_engine_range(metadata.requires("megatron-core"))
    assert allowed.contains(lock["transformer-engine"], prereleases=True), (lock["transformer-engine"], allowed)
    assert lock["transformer-engine-torch"] == lock["transformer-engine"]


def test_dockerfile_parses_and_installs_its_pythons_lock():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM nvidia/cuda:13\.\d+\.\d+-cudnn-devel-ubuntu24\.04$", text, re.M)  # CUDA 13: SGLang's torch
    assert "python3.12 -m venv" in text and "-r requirements/gpu-py312.lock" in text
    assert "COPY requirements/gpu-py312.lock" in text


def test_dockerfile_pins_equal_the_lock():
    lock = read_lock(LOCKS["3.12"])
    pins = re.findall(r"\b([A-Za-z][\w.-]*)==([\w.+]+)", DOCKERFILE.read_text())
    assert pins, "the Dockerfile pins its build tools"
    for name, version in pins:
        if canonicalize_name(name) in lock:
            assert lock[canonicalize_name(name)] == version, f"Dockerfile {name}=={version}, lock {lock[canonicalize_name(name)]}"
