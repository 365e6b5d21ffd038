"""`megarl plan`'s memory model on gpt-oss: the parameter count (sinks, biases on every linear and
expert) equals HF's own model's, and the KV cache keeps only the window on the windowed layers
(SGLang 0.5.23's hybrid sliding-window pool for GptOssForCausalLM)."""
import json
from pathlib import Path

import torch

from megarl.bridge import arch_from_hf_config
from megarl.placement.memory import kv_layer_tokens, total_params

GPT_OSS_20B = Path(__file__).resolve().parents[2] / "configs/recipes/models/gpt-oss-20b-bf16/config.json"


def test_gptoss_parameter_count_equals_hf_models():
    """A shrunk gpt-oss-20b (its options all on, sizes cut) built by transformers: every parameter counted."""
    import transformers

    config = json.loads(GPT_OSS_20B.read_text())
    config.update(hidden_size=48, intermediate_size=40, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                  num_local_experts=4, vocab_size=300, num_hidden_layers=4, layer_types=None, pad_token_id=0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**config))
    assert total_params(arch_from_hf_config(model.config.to_dict())) == sum(p.numel() for p in model.parameters())


def test_gptoss_20b_kv_cache_counts_the_window_on_alternate_layers():
    arch = arch_from_hf_config(json.loads(GPT_OSS_20B.read_text()))
    assert kv_layer_tokens(arch, 3072) == 12 * 3072 + 12 * 128
    assert kv_layer_tokens(arch, 100) == 24 * 100
    assert round(total_params(arch) / 1e9, 2) == 20.91  # OpenAI's model card: 21B parameters
