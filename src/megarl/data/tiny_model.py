"""Tiny real HuggingFace checkpoints with random weights, made offline (tests, CPU quickstart).

    make_tiny_model("qwen2", "outputs/quickstart/model")   # the quickstart's model
    AutoModelForCausalLM.from_pretrained("outputs/quickstart/model")

The defaults are the calibration of ../shared/reference/tiny-rl-on-cpu.md: a 2-layer Qwen2
(hidden 128, 4 heads, 2 KV heads, tied embeddings, ~302k parameters) with a character-level
tokenizer of 47 tokens. The chat template only puts <bos> before the prompt text, so "23+45="
is 7 tokens, and ends an assistant turn with <eos>.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3
CHARACTERS = "0123456789+-=>:?," + "abcdefghijklmnopqrstuvwxyz"  # one token each, ids 4..46
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)

ARCHITECTURES = {
    "qwen2": (Qwen2Config, {"use_sliding_window": False}),  # q/k/v projections with bias
    "llama": (LlamaConfig, {}),
    "qwen3": (Qwen3Config, {"use_sliding_window": False}),  # per-head q/k RMSNorm
    "mistral": (MistralConfig, {"sliding_window": None}),
    # mixture-of-experts: 8 experts, top-2 routing, every layer MoE (expert width: `intermediate`)
    "qwen3_moe": (Qwen3MoeConfig, {"use_sliding_window": False, "num_experts": 8, "num_experts_per_tok": 2,
                                   "norm_topk_prob": True}),  # as Qwen3-30B-A3B
    "qwen2_moe": (Qwen2MoeConfig, {"use_sliding_window": False, "num_experts": 8, "num_experts_per_tok": 2,
                                   "norm_topk_prob": False}),  # plus a shared expert (sigmoid-gated)
    "mixtral": (MixtralConfig, {"sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2}),
    # sinks, a window of 4 on even layers, biases, clamped SwiGLU, YaRN (factor 8 over 64 positions)
    "gpt_oss": (GptOssConfig, {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 4,
                               "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                   "original_max_position_embeddings": 64}}),
    # DeepSeek-V3's shape in small: multi-latent attention (q LoRA, rope / no-rope head dims), one dense
    # first layer, 8 experts in 4 groups (2 chosen), top-4, sigmoid routing scaled by 2.5, a shared expert
    "deepseek_v3": (DeepseekV3Config, {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                       "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                                       "norm_topk_prob": True,
                                       # fields of the hub config.json that SGLang's DeepseekV2 class reads
                                       "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}),
    # GLM-4.5's shape in small: DeepSeek-V3's router (8 experts in 4 groups, 2 chosen, top-4, sigmoid scaled
    # by 2.5, a shared expert, one dense first layer) on grouped-query attention with q/k/v biases, q/k
    # norms and rotary on half of each head
    "glm4_moe": (Glm4MoeConfig, {"n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                 "n_shared_experts": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                                 "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": True,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5}}),
}
# every layer MoE; not gpt_oss (these feed SGLang-backed tests, and SGLang on CPU does not serve it) nor
# deepseek_v3 / glm4_moe (a dense first layer)
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_char_tokenizer(max_length: int = 256) -> PreTrainedTokenizerFast:
    """One token per character of CHARACTERS, specials <pad> <bos> <eos> <unk>; any other
    character is <unk>. Built locally with `tokenizers`."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: Optional[int] = None,
    intermediate: Optional[int] = None,
    vocab: Optional[int] = None,
    tie: bool = True,
    max_positions: int = 256,
    dtype: str = "float32",
    seed: int = 0,
    mtp_layers: int = 0,
) -> Path:
    """Write a randomly initialised `arch` checkpoint (config.json, model.safetensors,
    generation_config.json) and the character tokenizer (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) to out_dir; return out_dir.

    head_dim: default hidden // heads. intermediate: MLP width, default 2 * hidden (MoE: each
    expert's width; Qwen2-MoE's shared expert is twice that). vocab: the
    embedding rows, default the tokenizer's 47; more pads the vocabulary (ids past 46 are never
    produced by the tokenizer), as real checkpoints pad to a multiple of 64 or 128. Same seed,
    same weights. mtp_layers (deepseek_v3, glm4_moe): that many multi-token-prediction layers after the
    last, stored as the hub stores them (`add_mtp_layers`).
    """
    if mtp_layers and arch not in ("deepseek_v3", "glm4_moe"):
        raise ValueError(f"mtp_layers: only deepseek_v3 and glm4_moe have multi-token-prediction layers, not {arch!r}")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads}), or give head_dim")
        head_dim = hidden // heads
    tokenizer = build_char_tokenizer(max_positions)
    vocab = len(tokenizer) if vocab is None else vocab
    if vocab < len(tokenizer):
        raise ValueError(f"vocab ({vocab}) must be at least the tokenizer's {len(tokenizer)} tokens")

    config_class, arch_kwargs = ARCHITECTURES[arch]
    ffn = 2 * hidden if intermediate is None else intermediate
    if arch in (*MOE_ARCHITECTURES, "deepseek_v3", "glm4_moe") and arch != "mixtral":  # Qwen, DeepSeek, GLM: expert width apart
        arch_kwargs = {**arch_kwargs, "moe_intermediate_size": ffn}
        if arch == "qwen2_moe":
            arch_kwargs["shared_expert_intermediate_size"] = 2 * ffn
    if arch == "deepseek_v3":  # multi-latent attention: every head its own key (kv_heads is not used);
        kv_heads = heads  # head_dim is the no-rope part's
        arch_kwargs = {**arch_kwargs, "q_lora_rank": hidden // 2, "kv_lora_rank": hidden // 4,
                       "qk_nope_head_dim": head_dim, "qk_rope_head_dim": head_dim // 2, "v_head_dim": head_dim}
        head_dim = head_dim // 2  # HF's rotary embedding reads `head_dim`: the rope part's
    config = config_class(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers + mtp_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **arch_kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if mtp_layers:
        add_mtp_layers(out, layers, mtp_layers, seed)
    return out


def add_mtp_layers(model_dir: Path, layers: int, mtp_layers: int, seed: int) -> None:
    """Turn the last `mtp_layers` decoder layers of the single-file checkpoint `model_dir` (HF's own
    `layers + mtp_layers` layers) into multi-token-prediction layers as DeepSeek-V3 / GLM-4.5 hub checkpoints
    store them: config.json `num_hidden_layers=layers`, `num_nextn_predict_layers=mtp_layers`, and each layer
    `model.layers.{layers + k}` also holds `enorm`, `hnorm`, `shared_head.norm` (1 + 0.2 N(0, 1)), `eh_proj`
    [H, 2H] (0.1 N(0, 1)) and copies of the embedding and LM head (`embed_tokens`, `shared_head.head`)."""
    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=mtp_layers)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = load_file(model_dir / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    head = tensors.get("lm_head.weight", embedding)
    hidden, dtype = embedding.shape[1], embedding.dtype
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(layers, layers + mtp_layers):
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
        tensors[f"model.layers.{i}.eh_proj.weight"] = (0.1 * torch.randn(hidden, 2 * hidden, generator=g)).to(dtype)
        tensors[f"model.layers.{i}.embed_tokens.weight"] = embedding.clone()
        tensors[f"model.layers.{i}.shared_head.head.weight"] = head.clone()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
