"""Shared fixtures of the end-to-end trainer tests: one tiny model and one synthetic dataset per
test session. (test_rl_e2e.py builds its own with its module fixture `tiny`, which takes precedence
there; it could use `tiny_assets` instead.)"""
from pathlib import Path

import pytest

from megarl.data.synthetic import write_task_dataset
from megarl.data.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """<root>/model: the tiny Qwen2 model (random, seed 0); <root>/data/{train,val}.parquet: the
    2-digit addition task (256 train, 16 validation prompts)."""
    root = tmp_path_factory.mktemp("tiny_assets")
    make_tiny_model("qwen2", root / "model", seed=0)
    write_task_dataset("add", root / "data", train_size=256, val_size=16, sft_size=0, seed=0)
    return root

