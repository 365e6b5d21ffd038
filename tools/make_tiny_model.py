#!/usr/bin/env python
"""Write a tiny random-weight HuggingFace checkpoint with a character-level tokenizer.

    python tools/make_tiny_model.py --arch qwen2 --out outputs/quickstart/model

Defaults are the quickstart's calibrated model (2 layers, hidden 128, 4 heads, 2 KV heads,
tied embeddings). The logic is megarl.data.tiny_model.make_tiny_model.

    python tools/make_tiny_model.py --reward-model --out outputs/tiny/reward_model

writes the same architecture as a reward model instead: `*ForSequenceClassification` with
num_labels=1 (a [1, hidden] `score.weight` in place of the LM head), pad_token_id set, the same
character tokenizer; it loads with `transformers.AutoModelForSequenceClassification`.
"""
import argparse
from pathlib import Path

import torch

from megarl.data.tiny_model import ARCHITECTURES, DTYPES, make_tiny_model


def make_tiny_reward_model(arch: str, out_dir, *, seed: int = 0, dtype: str = "float32", **sizes) -> Path:
    """A randomly initialised `arch` reward model (num_labels=1) of the sizes `make_tiny_model`
    takes, with its tokenizer, in out_dir; same seed, same weights. Returns out_dir."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    out = make_tiny_model(arch, out_dir, seed=seed, dtype=dtype, **sizes)  # config + tokenizer (+ LM weights)
    config = AutoConfig.from_pretrained(out, local_files_only=True)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    (out / "generation_config.json").unlink(missing_ok=True)  # a scorer does not generate
    model.to(DTYPES[dtype]).save_pretrained(out)  # replaces the LM's model.safetensors
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=list(ARCHITECTURES), default="qwen2")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width; default: 2 x hidden")
    p.add_argument("--vocab", type=int, default=None, help="embedding rows; default: the tokenizer's 47")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True, help="tie input and output embeddings")
    p.add_argument("--max-positions", type=int, default=256)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mtp-layers", type=int, default=0,
                   help="multi-token-prediction layers after the last (deepseek_v3, glm4_moe), stored as the hub stores them")
    p.add_argument("--reward-model", action="store_true",
                   help="write a reward model (*ForSequenceClassification, num_labels=1) instead of a causal LM")
    a = p.parse_args(argv)
    make = make_tiny_reward_model if a.reward_model else make_tiny_model
    try:
        out = make(
            a.arch, a.out, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
            intermediate=a.intermediate, vocab=a.vocab, tie=a.tie, max_positions=a.max_positions, dtype=a.dtype, seed=a.seed,
            **({"mtp_layers": a.mtp_layers} if a.mtp_layers else {}),
        )
    except ValueError as exc:  # an impossible shape or size
        p.error(str(exc))
    print(f"wrote {a.arch} {'reward model' if a.reward_model else 'checkpoint'} to {out}")


if __name__ == "__main__":
    main()
