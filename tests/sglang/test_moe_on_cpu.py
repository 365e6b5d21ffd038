"""Which mixture-of-experts models megarl lets real SGLang 0.5.23 serve on a CPU
(`megarl.trainer.inputs.sglang_cpu_model_problem`, `sglang_tied_head_problem`), held to SGLang itself:
an allowed family's greedy log-probs equal HF transformers' float32 ones (glm4_moe's:
test_glm4_moe_serving.py), and each refused one names its cause in SGLang's source."""
import pytest

from push_world import server_samples
from real_sglang import TOLERANCE, load_hf, make_model, max_diff, start_sglang

from megarl.config import load_config
from megarl.trainer.inputs import SGLANG_CPU_MOE_SERVED, sglang_cpu_model_problem, sglang_tied_head_problem


def sglang_config(model_dir):
    return load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=sglang"])


@pytest.mark.slow  # a real SGLang server (20-35 s to start)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_sglang_serves_an_untied_moe_model_on_the_cpu_with_hfs_log_probs(tmp_path, arch):
    """Softmax top-2 of 8 experts, renormalized (qwen3_moe's norm_topk_prob, as Qwen3-30B-A3B; mixtral's
    top-k softmax): SGLang's CPU path (topk.py fused_topk_torch_native, fused_moe_native.py
    moe_forward_native) gives HF's log-probs."""
    model = make_model(arch, tmp_path / arch, tie=False)
    config = sglang_config(model)
    assert arch in SGLANG_CPU_MOE_SERVED
    assert sglang_cpu_model_problem(config) is None and sglang_tied_head_problem(config) is None
    server = start_sglang(model, tmp_path, name=f"sglang-{arch}")
    try:
        samples = server_samples(server.url)
    finally:
        server.stop()
    assert max_diff(load_hf(model), samples) < TOLERANCE


@pytest.mark.parametrize("arch, tie, rule, cause", [
    # measured: the tied tiny qwen3_moe served 0.07 nats from HF's, 0.71 with every expert's output zero
    ("qwen3_moe", True, sglang_tied_head_problem, "srt/models/qwen3_moe.py never ties its output layer"),
    ("qwen2_moe", False, sglang_cpu_model_problem, "fused_gate_sigmoid_mul_add"),  # measured: exits at a request
    ("deepseek_v3", False, sglang_cpu_model_problem, "get_rope_cpu asserts it"),  # measured: exits at start
])
def test_the_moe_models_sglang_cannot_serve_are_refused_with_the_cause(tmp_path, arch, tie, rule, cause):
    problem = rule(sglang_config(make_model(arch, tmp_path / arch, tie=tie)))
    assert problem is not None and cause in problem and f"with a {'tied ' if tie else ''}{arch}" in problem


def test_dense_and_untied_models_are_not_refused(tmp_path):
    for arch, tie in (("qwen2", True), ("glm4_moe", False)):
        config = sglang_config(make_model(arch, tmp_path / arch, tie=tie))
        assert sglang_cpu_model_problem(config) is None and sglang_tied_head_problem(config) is None
