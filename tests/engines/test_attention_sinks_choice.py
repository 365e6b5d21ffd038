"""Which core attention runs gpt-oss's sinks (softmax_type="learnable"), decided per case without
a GPU: megarl's CPU reference and megatron's local attention take them; transformer-engine layers
need transformer-engine >= 2.8.0 (megatron-core extensions/transformer_engine.py:1283)."""
import pytest

from megarl.engines.megatron.model import attention_sinks_problem


@pytest.mark.parametrize("softmax_type, attention, te_layers, te_version, refused", [
    ("vanilla", "spec", True, "2.5.0", False),         # no sinks: nothing to check
    ("learnable", "cpu_reference", False, None, False),  # CPU: megarl's CpuReferenceAttention
    ("learnable", "spec", False, None, False),          # GPU, local spec: DotProductAttention + SoftmaxOne
    ("learnable", "spec", True, "2.8.0", False),        # TEDotProductAttention, transformer-engine 2.8
    ("learnable", "spec", True, "2.11.0", False),
    ("learnable", "spec", True, "2.7.1", True),         # megatron-core's assert
    ("learnable", "spec", True, None, True),
])
def test_attention_sinks_need_an_attention_that_takes_them(softmax_type, attention, te_layers, te_version, refused):
    problem = attention_sinks_problem(softmax_type, attention=attention, transformer_engine_layers=te_layers,
                                      te_version=te_version)
    assert (problem is not None) == refused
    if refused:
        assert "transformer-engine >= 2.8.0" in problem


def test_gpt_oss_turns_off_the_fusions_that_would_change_or_refuse_it():
    """On CUDA with transformer-engine: YaRN keeps the unfused RoPE (the fused packed-sequence RoPE
    drops its concentration factor), biased linears keep the unfused bias-dropout-add (TEGroupedMLP
    refuses it); other models keep both."""
    from megarl.bridge import arch_from_hf_config
    from megarl.engines.megatron.model import fusion_flags

    common = dict(vocab_size=100, hidden_size=64, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
                  max_position_embeddings=64)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}
    gpu = dict(on_cuda=True, transformer_engine=True, lora=False, trains=True, apex_grad_accumulation=True)
    gpt_oss = fusion_flags(**gpu, arch=arch_from_hf_config(dict(common, model_type="gpt_oss", rope_parameters=yarn)))
    assert (gpt_oss["apply_rope_fusion"], gpt_oss["bias_dropout_fusion"], gpt_oss["bias_activation_fusion"]) == \
           (False, False, True)
    plain = fusion_flags(**gpu, arch=arch_from_hf_config(dict(common, model_type="gpt_oss", rope_parameters={
        "rope_type": "default", "rope_theta": 1e4})))
    assert (plain["apply_rope_fusion"], plain["bias_dropout_fusion"]) == (True, False)
    qwen = fusion_flags(**gpu, arch=arch_from_hf_config(dict(common, model_type="qwen3_moe", num_experts=8,
                                                             moe_intermediate_size=40, rope_theta=1e4)))
    assert (qwen["apply_rope_fusion"], qwen["bias_dropout_fusion"]) == (True, True)
