"""GLM-4.5 (glm4_moe) on real SGLang 0.5.23 (float32, on the CPU), its mixture-of-experts path included:
the tiny GLM of tests/trainer/sigmoid_moe.py (q/k/v biases, q/k norms, half-head rotary, a dense first
layer, sigmoid group-limited routing with a nonzero selection bias, a shared expert) serves HF
transformers' own log-probs, and a megatron actor's push through `WeightSync` of another checkpoint
(same selection bias: megarl never pushes it, SGLang keeps the one it loaded) lands under the names
SGLang's `Glm4MoeForCausalLM.load_weights` (srt/models/glm4_moe.py) takes: the server then serves the
pushed checkpoint's log-probs, not its own: glm4_moe is one of the families megarl lets SGLang serve on a
CPU (megarl.trainer.inputs.SGLANG_CPU_MOE_SERVED)."""
import sys
from pathlib import Path

import pytest

from push_world import push_one, server_samples
from real_sglang import CHANGED, TOLERANCE, load_hf, max_diff, start_sglang

from megarl.testing import run_gloo_workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from sigmoid_moe import biased_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow  # a real SGLang server (20-35 s to start) and a megatron rank


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """{"A": the served checkpoint (seed 0), "B": other weights (seed 1), the same selection biases}."""
    root = tmp_path_factory.mktemp("glm4_moe")
    for name, seed in (("A", 0), ("B", 1)):
        biased_tiny_model("glm4_moe", root / name, kv_heads=2, seed=seed)
    return {name: root / name for name in ("A", "B")}


def test_sglang_serves_glm4_moe_and_takes_megarls_push(glm, tmp_path):
    hf = {name: load_hf(path) for name, path in glm.items()}
    server = start_sglang(str(glm["A"]), tmp_path, name="sglang-glm")
    try:
        before = server_samples(server.url)
        (after,) = run_gloo_workers(push_one, 1, args=(server.url, str(glm["B"]), "distributed", str(tmp_path)),
                                    timeout_s=300)
    finally:
        server.stop()
    assert max_diff(hf["A"], before) < TOLERANCE
    assert max_diff(hf["B"], after) < TOLERANCE
    assert max_diff(hf["A"], after) > CHANGED  # the push changed what it serves
