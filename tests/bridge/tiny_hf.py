"""Tiny HF checkpoints of every supported architecture, built from a config with a fixed seed.

Each variant exercises one hard case of the mapping:
- llama: GQA 8 heads / 2 groups (2 groups < TP=4), llama3 rope scaling, untied;
- mistral: MQA (1 group), explicit head_dim (heads * head_dim != hidden), sliding window;
- qwen2: q/k/v bias, tied embeddings (PP > 1 keeps a copy on the last stage);
- qwen3: q/k norm, head_dim * heads != hidden.
All have 8 layers (PP=4 x VPP=2 holds one layer per chunk) and vocab 100, which megatron pads
(to 104 / 112 / 128 at TP 1 / 2 / 4 with make_vocab_size_divisible_by=8).
"""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 100
DIVISIBLE_BY = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8, rms_norm_eps=1e-6,
              initializer_range=0.1)  # larger than HF's 0.02: attention far from uniform, errors visible
VARIANTS = {
    "llama": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}
# token ids for logit checks: both ends of the vocabulary and the TP=2 / TP=4 shard boundaries
INPUT_IDS = torch.tensor([[0, 55, 56, 27, 28, 99, 31, 32, 64, 3, 83, 84], [99, 1, 2, 54, 57, 41, 42, 95, 7, 8, 25, 26]])


def hf_config(variant: str, **overrides):
    import transformers

    class_name, kwargs = VARIANTS[variant]
    return getattr(transformers, class_name)(**{**COMMON, **kwargs, **overrides})


def make_model(variant: str, seed: int = 0, **overrides):
    """The HF model of `variant` in fp32 eval mode. Norm weights and biases are randomised too
    (HF initialises them to 1 and 0, which would hide a misplaced norm or bias)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(variant, **overrides), attn_implementation="eager")
    return randomise_norms_and_biases(model).eval()


def randomise_norms_and_biases(model):
    """Norm weights ~ 1 + 0.1 N(0, 1) and biases ~ 0.1 N(0, 1), in place, from torch's global RNG."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_tokenizer(out_dir: Path) -> None:
    """A tiny word-level tokenizer, so that the converters have tokenizer files to copy."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(out_dir)


def write_checkpoint(variant: str, out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Save the tiny model of `variant` (and a tokenizer) as an HF checkpoint; return the model."""
    model = make_model(variant, seed, **overrides)
    model.to(dtype).save_pretrained(out_dir)
    save_tokenizer(out_dir)
    return model.float()


def logits(model, input_ids: torch.Tensor = INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from megarl.bridge.safetensors_io import HFCheckpointReader

    with HFCheckpointReader(hf_dir) as reader:
        return {name: reader.read(name) for name in reader.names()}
