"""The CPU stand-in for transformer-engine's attention where megatron's own cannot run: context
parallelism and packed (THD) sequences, for gloo worlds.

megatron-core's local attention refuses context parallelism (transformer/dot_product_attention.py:57
"Context parallelism is only supported by TEDotProductAttention!") and packed sequences (`assert
packed_seq_params is None`), and transformer-engine runs on GPUs only. `CpuReferenceAttention`
(the class `cpu_reference_attention()` returns) takes the core attention's place in megatron's local
layer spec (`with_core_attention`) when a role has CP > 1 or packed sequences without
transformer-engine layers: it all-gathers the keys and values of every CP rank's positions over the
CP group (megatron's `gather_from_sequence_parallel_region` on the CP group: all-gather forward,
reduce-scatter of the gradients back to their ranks backward, transformer-engine's
`cp_comm_type="all_gather"` scheme), and attends this rank's queries to the keys their positions may
see: the same sequence (packed: `cu_seqlens_q_padded`, else `cu_seqlens_q`, as megatron's RoPE reads
them), causal (key position <= query position), a real token of its sequence (packed: `cu_seqlens_q`,
transformer-engine's padding_causal mask), and within the sliding window where the model has one
(megatron's `window_size` = (left, 0): query position - key position <= left; on the layers
`window_attn_skip_freq` marks, transformer/utils.py `is_layer_window_attention`, layer numbers
global and 1-based as megatron's). With `softmax_type="learnable"` (gpt-oss's sinks) each head's
`softmax_offset` logit joins the softmax's denominator as a key with no value, as megatron's
`SoftmaxOne` does (fusions/fused_softmax.py); the parameter is split over TP by heads and
checkpointed under megatron's key (`DotProductAttention.sharded_state_dict`). Positions follow
megatron's CP layout (`context_parallel.positions_of_rank`, `thd_positions_of_rank`). A reference,
not a kernel: it materialises [heads, rows/CP, rows] scores. No attention dropout (megarl's models
have none).
"""
from __future__ import annotations

import copy
import functools
import math

import torch

from megarl.engines.megatron.context_parallel import positions_of_rank, thd_positions_of_rank


def thd_row_positions(cu_seqlens_padded: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position within it) [n] of `rows` [n] of a packed sequence laid out by
    `cu_seqlens_padded` [s + 1]."""
    starts = cu_seqlens_padded.long().to(rows.device)
    sequence = torch.searchsorted(starts, rows, right=True) - 1
    return sequence, rows - starts[sequence]


@functools.lru_cache(maxsize=None)
def cpu_reference_attention():
    """The `CpuReferenceAttention` class (defined on first use: megatron-core is imported then)."""
    from megatron.core.transformer.module import MegatronModule

    class CpuReferenceAttention(MegatronModule):
        """Core attention over the CP group: queries of this rank's positions ([s/CP, b, heads, d],
        or packed [t/CP, heads, d]); keys and values of its own positions, gathered from all CP
        ranks. Constructor and forward as megatron's `DotProductAttention` (megatron-core 0.16.1 / 0.19.2),
        plus transformer-engine's `k_channels` / `v_channels`, which multi-latent attention passes (its
        query/key head dim differs from its value head dim: multi_latent_attention.py MLASelfAttention;
        megatron's local DotProductAttention has no such arguments, so MLA runs on the CPU through this)."""

        def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
            from megatron.core import parallel_state
            from megatron.core.transformer.utils import is_layer_window_attention

            super().__init__(config=config)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if dropout:
                raise ValueError(f"CpuReferenceAttention has no attention dropout (got {dropout})")
            head_dim = config.kv_channels if k_channels is None else k_channels
            self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
            if config.apply_query_key_layer_scaling:
                raise ValueError("CpuReferenceAttention does not scale by the layer number "
                                 "(apply_query_key_layer_scaling)")
            windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            self.window = config.window_size[0] if windowed else None
            if config.softmax_type not in ("vanilla", "learnable"):
                raise ValueError(f"CpuReferenceAttention: softmax_type={config.softmax_type!r} is not supported "
                                 "('vanilla' or 'learnable')")
            self.softmax_offset = None
            if config.softmax_type == "learnable":  # [heads / TP], this rank's heads
                heads = config.num_attention_heads // parallel_state.get_tensor_model_parallel_world_size()
                self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            self.cp_group = parallel_state.get_context_parallel_group()
            self.cp = parallel_state.get_context_parallel_world_size()
            self.cp_rank = parallel_state.get_context_parallel_rank()

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            """query and key [s, b, np / ng, d], value [s, b, ng, dv] of this rank's s = S/CP positions ->
            context [s, b, np * dv]; packed, [t, np / ng, d] and [t, ng, dv] -> [t, np * dv]."""
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            if attention_bias is not None:
                raise ValueError("CpuReferenceAttention takes no attention bias")
            packed = packed_seq_params is not None
            if self.cp == 1 and not packed and self.window is None and self.softmax_offset is None:  # torch's kernel
                return self._causal(query, key, value)
            if packed:
                if packed_seq_params.qkv_format != "thd":
                    raise ValueError(f"CpuReferenceAttention takes packed sequences in the thd format, not "
                                     f"{packed_seq_params.qkv_format!r}")
                query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            s, b, heads, d = query.shape
            if self.cp > 1:  # [CP * s, b, ng, d]: rank 0's positions, then rank 1's, ... (gradients reduce-scattered back)
                key = gather_from_sequence_parallel_region(key, True, self.cp_group)
                value = gather_from_sequence_parallel_region(value, True, self.cp_group)
            hidden = self._hidden(s * self.cp, packed_seq_params, query.device)  # [s, CP * s]
            groups = key.shape[2]
            key = key.repeat_interleave(heads // groups, dim=2)  # GQA: query head h reads key/value group h // (np/ng)
            value = value.repeat_interleave(heads // groups, dim=2)
            scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.softmax_scale
            scores = scores.masked_fill(hidden, float("-inf"))
            if self.softmax_offset is None:
                probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
            else:  # the sink: one more logit per head in the denominator [b, heads, s, t + 1], then dropped
                sink = self.softmax_offset.reshape(1, -1, 1, 1).expand(b, -1, s, 1).to(scores.dtype)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(value.dtype)
            context = torch.einsum("bhst,tbhd->sbhd", probs, value)
            dv = value.shape[-1]
            return context.reshape(s, heads * dv) if packed else context.reshape(s, b, heads * dv)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """The sinks split by heads over TP, under megatron's key (dot_product_attention.py
            `DotProductAttention.sharded_state_dict`); nothing without them."""
            from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
            from megatron.core import parallel_state

            if self.softmax_offset is None:
                return {}
            dp_cp_group = (metadata or {}).get("dp_cp_group")
            if dp_cp_group is None:
                dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
                tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=dp_cp_group)

        def _causal(self, query, key, value):
            """query and key [s, b, np / ng, d], value [s, b, ng, dv] -> context [s, b, np * dv]: plain causal
            attention through torch's `scaled_dot_product_attention` (its fused CPU kernel, the one HF's
            models use on CPU by default; no [s, s] scores kept for the backward)."""
            s, b, heads, d = query.shape
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads)
            return context.permute(2, 0, 1, 3).reshape(s, b, heads * v.shape[-1])

        def _hidden(self, length: int, packed_seq_params, device) -> torch.Tensor:
            """[length / CP, length] bool: which keys (all CP ranks' rows, rank 0's first) each of this
            rank's queries may not see."""
            if packed_seq_params is None:
                query_pos = positions_of_rank(length, self.cp, self.cp_rank).to(device)
                key_pos = torch.cat([positions_of_rank(length, self.cp, r) for r in range(self.cp)]).to(device)
                hidden = query_pos[:, None] < key_pos[None, :]
            else:
                cu = packed_seq_params.cu_seqlens_q.long().cpu()
                padded = packed_seq_params.cu_seqlens_q_padded
                padded = cu if padded is None else padded.long().cpu()
                if int(padded[-1]) != length:
                    raise ValueError(f"the packed sequences' cu_seqlens end at {int(padded[-1])}, but the CP group "
                                     f"holds {length} rows")
                real = cu[1:] - cu[:-1]  # each sequence's real tokens
                query_seq, query_pos = thd_row_positions(padded, thd_positions_of_rank(padded, self.cp, self.cp_rank))
                key_seq, key_pos = thd_row_positions(
                    padded, torch.cat([thd_positions_of_rank(padded, self.cp, r) for r in range(self.cp)]))
                hidden = ((query_seq[:, None] != key_seq[None, :]) | (query_pos[:, None] < key_pos[None, :])
                          | (key_pos >= real[key_seq])[None, :])
                hidden, query_pos, key_pos = hidden.to(device), query_pos.to(device), key_pos.to(device)
            if self.window is not None:
                hidden |= query_pos[:, None] - key_pos[None, :] > self.window
            return hidden

    return CpuReferenceAttention


def with_core_attention(spec, core_attention):
    """A copy of a megatron `TransformerLayer` spec whose self-attention uses `core_attention`."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec
