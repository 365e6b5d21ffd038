"""HF config.json -> ModelArch -> megatron-core TransformerConfig / GPTModel arguments."""
import pytest
import torch

from megarl.bridge import ConversionError, ParallelLayout, arch_from_hf_config, check_layout
from megarl.bridge.arch import RopeScaling
from megarl.bridge.megatron_config import gpt_model_kwargs, transformer_config_kwargs
from tiny_hf import hf_config


def arch_of(variant, **overrides):
    return arch_from_hf_config(hf_config(variant, **overrides).to_dict())


def test_each_family_translates_its_distinctive_fields():
    llama, mistral, qwen2, qwen3 = (arch_of(v) for v in ("llama", "mistral", "qwen2", "qwen3"))
    assert (llama.num_attention_heads, llama.num_query_groups, llama.kv_channels) == (8, 2, 8)
    assert llama.rope_scaling == RopeScaling("llama3", 8.0) and not llama.tie_word_embeddings
    assert (mistral.num_query_groups, mistral.kv_channels, mistral.sliding_window) == (1, 32, 6)
    assert mistral.rope_theta == 1000.0
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and not qwen2.qk_layernorm
    assert qwen3.qk_layernorm and not qwen3.qkv_bias and qwen3.kv_channels * qwen3.num_attention_heads != qwen3.hidden_size
    assert qwen3.sliding_window is None and qwen2.sliding_window is None


def test_pre_transformers5_rope_fields_are_read():
    config = hf_config("llama").to_dict()
    del config["rope_parameters"]
    config.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    arch = arch_from_hf_config(config)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling == RopeScaling("linear", 2.0)


@pytest.mark.parametrize(
    "variant, change, field",
    [
        ("llama", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 2.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
         "low_freq_factor"),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads"),
        ("llama", {"model_type": "gpt2"}, "model_type"),
        ("qwen2", {"layer_types": ["sliding_attention"] * 8}, "layer_types"),
        ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_unsupported_settings_are_rejected_naming_the_field(variant, change, field):
    config = {**hf_config(variant).to_dict(), **change}
    with pytest.raises(ConversionError, match=field) as e:
        arch_from_hf_config(config, source="/models/x/config.json")
    assert "/models/x/config.json" in str(e.value)


@pytest.mark.parametrize(
    "layout, field",
    [(ParallelLayout(tp=3), "num_attention_heads"), (ParallelLayout(pp=3), "num_hidden_layers"),
     (ParallelLayout(pp=2, vpp=3), "num_hidden_layers")],
)
def test_layouts_that_cannot_split_the_model_are_rejected(layout, field):
    with pytest.raises(ConversionError, match=field):
        check_layout(arch_of("llama"), layout)


def test_kv_groups_must_divide_or_be_divided_by_tp():
    check_layout(arch_of("llama"), ParallelLayout(tp=4))  # 2 groups, TP 4: megatron replicates groups
    with pytest.raises(ConversionError, match="num_key_value_heads"):
        check_layout(arch_of("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3), ParallelLayout(tp=2))
    with pytest.raises(ConversionError, match="vpp > 1 needs pp > 1"):
        ParallelLayout(vpp=2)


def test_megatron_config_is_built_from_the_arch():
    from megatron.core.transformer.transformer_config import TransformerConfig

    mistral = arch_of("mistral")
    config = TransformerConfig(**transformer_config_kwargs(mistral, ParallelLayout(tp=2, pp=2, vpp=2), torch.bfloat16))
    assert (config.num_query_groups, config.kv_channels, config.window_size) == (1, 32, (5, 0))
    assert config.bf16 and config.virtual_pipeline_model_parallel_size == 2 and not config.add_bias_linear
    qwen2 = TransformerConfig(**transformer_config_kwargs(arch_of("qwen2")))
    assert qwen2.add_qkv_bias and not qwen2.qk_layernorm and qwen2.window_size is None
    assert TransformerConfig(**transformer_config_kwargs(arch_of("qwen3"))).qk_layernorm
    llama = gpt_model_kwargs(arch_of("llama"), padded_vocab_size=104)
    assert llama["rope_scaling"] and llama["rope_scaling_factor"] == 8.0 and llama["vocab_size"] == 104
    assert gpt_model_kwargs(arch_of("qwen2"), 104)["share_embeddings_and_output_weights"]
    linear = arch_from_hf_config({**hf_config("llama").to_dict(),
                                  "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}})
    assert gpt_model_kwargs(linear, 104)["seq_len_interpolation_factor"] == 4.0


@pytest.mark.parametrize("config_class", ["Qwen3NextConfig", "Qwen3_5Config", "Qwen3_5TextConfig", "Qwen3_5MoeConfig",
                                          "Qwen3_5MoeTextConfig"])
def test_gated_delta_net_families_are_refused_saying_what_blocks_them(config_class):
    """transformers' own configs (their model_type as a checkpoint's config.json has it) are refused with
    the blocker named, not as an unknown model_type."""
    import transformers

    config = getattr(transformers, config_class)().to_dict()
    with pytest.raises(ConversionError) as e:
        arch_from_hf_config(config, source="/models/x/config.json")
    text = str(e.value)
    assert text.startswith(f"/models/x/config.json: `model_type`={config['model_type']!r}: its gated delta net")
    with pytest.raises(ConversionError) as e:  # a checkpoint's config.json names its class too
        arch_from_hf_config({**config, "architectures": ["Qwen3NextForCausalLM"]}, source="/models/x/config.json")
    assert str(e.value).startswith(f"/models/x/config.json: architecture Qwen3NextForCausalLM "
                                   f"(`model_type`={config['model_type']!r}): its gated delta net")
    for blocker in ("flash-linear-attention", "0 active drivers", "`l2norm`", "deterministic_mode=True"):
        assert blocker in text
    assert "megarl maps these HF architectures" not in text


def test_megatron_gated_delta_net_cannot_be_built_without_fla():
    """The first blocker the refusal names, checked on megatron-core itself: its GatedDeltaNet raises
    before anything else in its constructor where `fla` (flash-linear-attention) does not import."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    with pytest.raises(ImportError, match="FLA is not installed"):
        GatedDeltaNet(config=None, submodules=None)
