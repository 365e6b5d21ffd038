"""The real-SGLang tier: SGLang 0.5.23 itself serving on the CPU (`make install-sglang`), started by
megarl's own launch code (`megarl.rollout.launch`), one server per module where a module can share it."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from real_sglang import make_model, start_sglang  # noqa: E402


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    """The quickstart's tiny Qwen2 in float32 (47-token character vocabulary), with its tokenizer."""
    return make_model("qwen2", tmp_path_factory.mktemp("sglang-qwen2"))


@pytest.fixture(scope="module")
def sglang_server(qwen2_dir, tmp_path_factory):
    """One real SGLang server for the module: the tiny Qwen2 in float32, no API key."""
    server = start_sglang(qwen2_dir, tmp_path_factory.mktemp("sglang-logs"), name="sglang")
    yield server
    server.stop()
