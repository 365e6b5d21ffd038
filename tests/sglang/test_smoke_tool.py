"""tools/sglang_smoke.py, the GPU smoke test of the rollout stack, run with `--device cpu` against real
SGLang 0.5.23 (its own server, from .venv-sglang): the same script a first GPU run starts, every step
of it on the tiny Qwen2 in float32. Its checks are held to independent oracles inside the script
(transformers' own model, the actor's megatron forward, SGLang's own answers); here: it exits 0 and
printed each check the GPU run relies on."""
import re
import sys

import pytest

from megarl.testing import run_to_completion
from real_sglang import REPO, make_model, sglang_python

pytestmark = pytest.mark.slow

ROUNDS = 20


def test_the_smoke_script_passes_against_real_sglang_on_cpu(tmp_path):
    model = make_model("qwen2", tmp_path / "model")
    cmd = [sys.executable, str(REPO / "tools" / "sglang_smoke.py"), model, "--device", "cpu",
           "--server-python", sglang_python(), "--rounds", str(ROUNDS), "--log-dir", str(tmp_path / "logs")]
    output = run_to_completion(cmd, tmp_path, 540, "tools/sglang_smoke.py --device cpu")
    assert "[FAIL]" not in output and output.rstrip().endswith("all checks passed"), output[-6000:]
    # the API key: every call carried it, and calls without it were refused
    for refused in ["server GET /model_info", "server POST /generate", "router POST /generate"]:
        assert f"[ok] {refused} without the key: HTTP 401 (401 expected)" in output
    # teacher scoring: asked at T=0.7, SGLang's input log-probs are transformers' at T=1, not at T=0.7
    assert "[ok] scores asked at T=0.7 equal hf's log_softmax at T=1" in output
    assert "[ok] and differ from hf's at T=0.7" in output
    # the production push, colocated order, into the real server
    assert "[ok] the server and the actor on the checkpoint" in output
    assert "[ok] the actor's update moved its log-probs" in output
    assert "[ok] after the push: max |diff| sglang - actor" in output
    rounds = re.findall(r"\[ok\] round (\d+): max \|diff\| sglang - actor ", output)
    assert [int(r) for r in rounds] == list(range(1, ROUNDS + 1))
    assert f"[ok] {ROUNDS} rounds: greedy log-probs equal the actor's every round" in output
