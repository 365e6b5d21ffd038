"""Shared fixtures: the tiny HF checkpoints of every supported architecture (built once)."""
import sys
from pathlib import Path

import pytest

# the helper modules next to this file are imported by name, also by gloo workers
sys.path.insert(0, str(Path(__file__).parent))

from tiny_hf import VARIANTS, write_checkpoint


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{variant: (HF checkpoint dir, fp32 HF model)} for every variant of tiny_hf.VARIANTS."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {v: (root / v, write_checkpoint(v, root / v, seed=i)) for i, v in enumerate(VARIANTS)}
