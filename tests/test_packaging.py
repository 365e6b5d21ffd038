"""What a user installs says the truth: setup.py's pins, the lock files of the tested lines
(requirements/gpu-py3*.lock and cpu-py3*.lock, the benchmarks' bench-py311.lock, all written by
`make lock`), `megarl doctor`'s tested range and docker/Dockerfile agree with each other and with
megatron-core's own metadata; and the venv running the tests holds exactly its line's CPU lock."""
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
from packaging.version import Version

from megarl.launch import doctor

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {"3.11": ROOT / "requirements" / "gpu-py311.lock", "3.12": ROOT / "requirements" / "gpu-py312.lock"}
CPU_LOCKS = {"3.11": ROOT / "requirements" / "cpu-py311.lock", "3.12": ROOT / "requirements" / "cpu-py312.lock"}
BENCH_LOCK = ROOT / "requirements" / "bench-py311.lock"
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


def this_python() -> str:
    return ".".join(platform.python_version().split(".")[:2])


def installed() -> dict:
    """{canonical name: version} of `pip freeze --all` of this interpreter, without megarl (an
    editable install of this checkout) and pip (`make install` upgrades it before the lock)."""
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"],
                            capture_output=True, text=True, timeout=120, check=True).stdout
    found = {}
    for line in freeze.splitlines():
        assert "==" in line, f"pip freeze: {line!r} is not a released version"
        name, version = line.split("==")
        found[canonicalize_name(name)] = version
    return {name: version for name, version in found.items() if name not in ("megarl", "pip")}


def test_this_venv_holds_exactly_its_lines_cpu_lock():
    """`make install` installs requirements/cpu-py3X.lock: every locked version and nothing else.
    A local version label is the build pip found (`2.13.0+cpu`); the lock's `==2.13.0` admits it."""
    lock, have = read_lock(CPU_LOCKS[this_python()]), installed()
    wrong = [f"{n}: installed {have[n]}, locked {v}" for n, v in lock.items()
             if n in have and Version(have[n]).public != v]
    missing = sorted(set(lock) - set(have))
    extra = sorted(f"{n}=={have[n]}" for n in set(have) - set(lock))
    assert not (wrong or missing or extra), (
        f"{sys.prefix} differs from {CPU_LOCKS[this_python()].name} (`make install` installs the lock; "
        f"a package added by hand belongs in setup.py and `make lock`):\n"
        f"  other versions: {wrong}\n  not installed: {missing}\n  not in the lock: {extra}")


def test_the_installed_set_satisfies_every_declared_requirement():
    """pip's own check over this venv: the locked set is one a resolver could have chosen."""
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("python", sorted(CPU_LOCKS))
def test_every_setup_py_test_requirement_admits_the_cpu_locked_version(python):
    lock = read_lock(CPU_LOCKS[python])
    # dev tools: line 1, where developers work; ENVS (the connectors' libraries) is in the test extra
    lists = ["CORE", "TEST", "ENVS"] + (["DEV"] if python == "3.11" else [])
    for line in [r for key in lists for r in setup_py()[key]]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in lock, f"{req.name} (setup.py) is missing from {CPU_LOCKS[python].name}"
        assert req.specifier.contains(lock[name], prereleases=True), \
            f"setup.py asks {line!r}, {CPU_LOCKS[python].name} has {lock[name]}"
    assert lock["torch"] == "2.13.0" and lock["megatron-core"] == read_lock(LOCKS[python])["megatron-core"]
    assert "megarl" not in lock and "pip" not in lock


def test_the_bench_lock_adds_trl_to_the_cpu_lock_and_pins_nothing_twice():
    """.venv-bench shares .venv's packages and installs the bench lock with --no-deps on top: a
    package in both locks would shadow .venv's. TRL, accelerate and datasets are each pinned once."""
    bench, cpu = read_lock(BENCH_LOCK), read_lock(CPU_LOCKS["3.11"])
    assert set(bench) & set(cpu) == set()
    for name in ("trl", "accelerate", "datasets"):
        assert (name in bench) + (name in cpu) == 1, name
    script = (ROOT / "tools" / "bench" / "setup_bench_env.sh").read_text()
    assert "--no-deps -r \"$lock\"" in script and 'requirements/bench-py$minor.lock' in script

