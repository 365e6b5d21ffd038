"""Greedy accuracy of an HF checkpoint on a verl validation parquet, with plain transformers
`generate` (no megarl engine), scored like megarl's `val/score`: megarl's exact match of the
response decoded with its special tokens and cut at the first end marker. Used by trl_grpo.py
(the TRL side) and opd_vs_grpo.py (the teacher's and the student's accuracy before RL).
"""
from __future__ import annotations

import pyarrow.parquet as pq
import torch

from megarl.rewards.synthetic import exact_match


def load_rows(path: str, limit: int | None = None) -> list[dict]:
    """verl parquet rows -> {"prompt": chat messages, "ground_truth": answer}."""
    rows = pq.read_table(path).to_pylist()[:limit]
    return [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, batch: int = 512) -> float:
    """Mean exact match (0..1) of greedy responses of at most max_new_tokens tokens over `rows`
    (left-padded batches of `batch` prompts, the tokenizer's chat template)."""
    model.eval()
    correct = 0.0
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in chunk]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for ids, r in zip(out[:, enc["input_ids"].shape[1]:], chunk):
            correct += exact_match(tokenizer.decode(ids, skip_special_tokens=False), r["ground_truth"])
    return correct / len(rows)


def checkpoint_accuracy(model_dir: str, val_parquet: str, max_new_tokens: int) -> float:
    """greedy_accuracy of the float32 HF checkpoint in model_dir on every row of val_parquet."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_accuracy(model, tokenizer, load_rows(val_parquet), max_new_tokens)
