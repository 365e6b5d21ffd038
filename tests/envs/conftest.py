"""Shared checks and fixtures of the connector tests (agent_batches.py: what they read from a batch)."""
import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))  # agent_batches.py


@pytest.fixture
def supported_range_is_setup_pys():
    """check(package, supported): see `_check_supported_range`."""
    return _check_supported_range


def _check_supported_range(package: str, supported) -> None:
    """setup.py's `ENVS` requirement of `package` is `supported` (the connector's SpecifierSet), and the
    installed version is inside it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (envs,) = [ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
               and getattr(n.targets[0], "id", None) == "ENVS"]
    (line,) = [r for r in envs if Requirement(r).name == package]
    assert Requirement(line).specifier == supported
    assert importlib.metadata.version(package) in supported


@pytest.fixture
def installed_version(monkeypatch):
    """set(package, version): importlib.metadata reports `version` for `package` (None: not installed)."""
    real = importlib.metadata.version

    def set_version(package: str, version):
        def fake(name):
            if name != package:
                return real(name)
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        monkeypatch.setattr(importlib.metadata, "version", fake)

    return set_version


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny qwen2 model's tokenizer."""
    from transformers import AutoTokenizer

    from megarl.data.tiny_model import make_tiny_model

    return AutoTokenizer.from_pretrained(make_tiny_model("qwen2", tmp_path_factory.mktemp("tiny"), seed=0))
