"""gpt-oss weight pushes are refused by name: SGLang 0.5.23's GptOssForCausalLM.load_weights loads a
layer's experts only as fused tensors of all its experts, and skips per-expert names (its own
source is the oracle), which is what megarl's push sends."""
import re
from pathlib import Path

import pytest

from megarl.bridge import WeightMap, arch_from_hf_config
from megarl.sync.weight_sync import SyncConfig, WeightSync, push_problem

SGLANG_GPT_OSS = Path("/work/main/.venv-sglang/lib/python3.11/site-packages/sglang/srt/models/gpt_oss.py")
GPT_OSS = dict(model_type="gpt_oss", vocab_size=100, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=4, max_position_embeddings=64,
               rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def test_gptoss_push_is_refused_because_sglang_loads_only_fused_experts():
    weights = WeightMap(arch_from_hf_config(GPT_OSS), 128)
    source = SGLANG_GPT_OSS.read_text()
    # SGLang maps only the fused names onto its FusedMoE parameters (`experts.{ckpt_gate_up_proj_name}`)
    assert 'ckpt_gate_up_proj_name="gate_up_proj"' in source and "make_expert_params_mapping_fused" in source
    fused = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")
    pushed = [n for n in weights.hf_names() if ".experts." in n]
    assert pushed and not any(f in n for n in pushed for f in fused)  # per-expert names: skipped by SGLang
    assert all(re.search(r"\.experts\.\d+\.", n) for n in pushed)
    assert "SGLang's GptOssForCausalLM.load_weights" in push_problem(weights)
    with pytest.raises(ValueError, match="gpt-oss weights cannot be pushed"):
        WeightSync([], weights, ["http://127.0.0.1:1"], SyncConfig(backend="gloo"))
    qwen = dict(GPT_OSS, model_type="qwen3_moe", moe_intermediate_size=40, num_experts=8)
    assert push_problem(WeightMap(arch_from_hf_config(qwen), 128)) is None
