"""Shared fixtures: the tiny HF checkpoints of every supported architecture (built once)."""
import sys
from pathlib import Path

import pytest
import tqdm

# No tqdm monitor thread: a progress bar (transformers' save_pretrained, the converter's) leaves one
# running, and with a second Python thread alive run_gloo_workers spawns its ranks, each importing
# torch and megatron again (megarl.testing.gloo_start_method), instead of forking them.
tqdm.tqdm.monitor_interval = 0

# the helper modules next to this file are imported by name, also by spawned gloo workers
sys.path.insert(0, str(Path(__file__).parent))

from tiny_hf import VARIANTS, write_checkpoint


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{variant: (HF checkpoint dir, fp32 HF model)} for every variant of tiny_hf.VARIANTS."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {v: (root / v, write_checkpoint(v, root / v, seed=i)) for i, v in enumerate(VARIANTS)}
