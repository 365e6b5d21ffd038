"""The CPU stand-in for transformer-engine's context-parallel attention, for gloo worlds.

megatron-core's own local attention refuses context parallelism (transformer/dot_product_attention.py:57
"Context parallelism is only supported by TEDotProductAttention!"), and transformer-engine runs on
GPUs only. `CpuContextParallelAttention` (the class `cpu_context_parallel_attention()` returns)
takes the core attention's place in megatron's local layer spec (`with_core_attention`) when a
role has CP > 1 without transformer-engine layers: it
all-gathers the keys and values of every CP rank's positions over the CP group (megatron's
`gather_from_sequence_parallel_region` on the CP group: all-gather forward, reduce-scatter of the
gradients back to their ranks backward, transformer-engine's `cp_comm_type="all_gather"` scheme), and
attends this rank's queries to the keys their positions may see: causal (key position <= query
position) and within the sliding window where the model has one (megatron's `window_size` = (left, 0):
query position - key position <= left). Positions follow megatron's CP layout
(`context_parallel.positions_of_rank`). A reference, not a kernel: it materialises [b, heads, S/CP, S]
scores. Padded sequence layout only (no packed sequences), no attention dropout (megarl's models have none).
"""
from __future__ import annotations

import copy
import functools
import math

import torch

from megarl.engines.megatron.context_parallel import positions_of_rank


@functools.lru_cache(maxsize=None)
def cpu_context_parallel_attention():
    """The `CpuContextParallelAttention` class (defined on first use: megatron-core is imported then)."""
    from megatron.core.transformer.module import MegatronModule

    class CpuContextParallelAttention(MegatronModule):
        """Core attention over the CP group ([s/CP, b, heads, d] queries of this rank; keys and values
        of its own positions, gathered from all CP ranks). Constructor and forward as megatron's
        `DotProductAttention` (megatron-core 0.16.1 / 0.19.2)."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            from megatron.core import parallel_state

            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout:
                raise ValueError(f"CpuContextParallelAttention has no attention dropout (got {dropout})")
            head_dim = config.kv_channels
            self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
            if config.apply_query_key_layer_scaling:
                raise ValueError("CpuContextParallelAttention does not scale by the layer number "
                                 "(apply_query_key_layer_scaling)")
            self.window = None if config.window_size is None else config.window_size[0]
            self.cp_group = parallel_state.get_context_parallel_group()
            self.cp = parallel_state.get_context_parallel_world_size()
            self.cp_rank = parallel_state.get_context_parallel_rank()

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            """query [s, b, np, d], key and value [s, b, ng, d] of this rank's s = S/CP positions ->
            context [s, b, np * d]."""
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("CpuContextParallelAttention takes padded sequences without an attention bias")
            s, b, heads, d = query.shape
            # [CP * s, b, ng, d]: rank 0's positions, then rank 1's, ... (autograd: gradients reduce-scattered back)
            key = gather_from_sequence_parallel_region(key, True, self.cp_group)
            value = gather_from_sequence_parallel_region(value, True, self.cp_group)
            length = s * self.cp
            query_pos = positions_of_rank(length, self.cp, self.cp_rank).to(query.device)
            key_pos = torch.cat([positions_of_rank(length, self.cp, r) for r in range(self.cp)]).to(query.device)
            hidden = query_pos[:, None] < key_pos[None, :]  # [s, CP * s]
            if self.window is not None:
                hidden |= query_pos[:, None] - key_pos[None, :] > self.window
            groups = key.shape[2]
            key = key.repeat_interleave(heads // groups, dim=2)  # GQA: query head h reads key/value group h // (np/ng)
            value = value.repeat_interleave(heads // groups, dim=2)
            scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.softmax_scale
            scores = scores.masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
            context = torch.einsum("bhst,tbhd->sbhd", probs, value)
            return context.reshape(s, b, heads * d)

    return CpuContextParallelAttention


def with_core_attention(spec, core_attention):
    """A copy of a megatron `TransformerLayer` spec whose self-attention uses `core_attention`."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec
