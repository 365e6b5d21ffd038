"""Pure tensor transforms between HF and megatron-core layouts (full, unsharded tensors).

Notation: nh attention heads, ng query groups (HF `num_key_value_heads`), d head dim
(`kv_channels`), r = nh / ng, H hidden size, F ffn size, V vocab size, Vp padded vocab size.
Every function returns new tensors or views; none modifies its input. All are bit-exact.
"""
from __future__ import annotations

import torch


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, nh: int, ng: int, d: int) -> torch.Tensor:
    """HF q [nh*d, ...], k [ng*d, ...], v [ng*d, ...] -> megatron `linear_qkv` [ng*(r+2)*d, ...].

    megatron groups rows per query group g: the r query heads of g, then k_g, then v_g
    (attention.py `get_query_key_value_tensors` views the output as [.., ng, (r+2)*d]).
    Works for weights ([out, H]) and biases ([out]).
    """
    tail = q.shape[1:]
    r = nh // ng
    return torch.cat(
        [q.reshape(ng, r * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1
    ).reshape(ng * (r + 2) * d, *tail)


def split_qkv(qkv: torch.Tensor, nh: int, ng: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv`: megatron `linear_qkv` [ng*(r+2)*d, ...] -> HF (q, k, v)."""
    tail = qkv.shape[1:]
    r = nh // ng
    groups = qkv.reshape(ng, (r + 2) * d, *tail)
    q = groups[:, : r * d].reshape(nh * d, *tail)
    k = groups[:, r * d : (r + 1) * d].reshape(ng * d, *tail)
    v = groups[:, (r + 1) * d :].reshape(ng * d, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate_proj [F, H] and up_proj [F, H] -> megatron `linear_fc1` [2F, H] = [gate; up]
    (mlp.py: the activation applies to the first half)."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `merge_gate_up`: [2F, H] -> (gate [F, H], up [F, H])."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary: the smallest multiple of divisible_by * tp that is >= vocab_size."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def pad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    """[V, H] -> [Vp, H] with zero rows appended (embedding / output layer)."""
    extra = padded_size - weight.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad a vocabulary of {weight.shape[0]} rows down to {padded_size}")
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[Vp, H] -> [V, H]: drop megatron's padding rows."""
    if weight.shape[0] < vocab_size:
        raise ValueError(f"a vocabulary of {weight.shape[0]} rows has no room for {vocab_size} tokens")
    return weight[:vocab_size].contiguous() if weight.shape[0] > vocab_size else weight
