"""A transformers KV cache whose full-attention layers write into buffers allocated once per batch.

`DynamicLayer.update` concatenates every decode step (the whole cache is copied per token). The
`PreallocatedLayer` here allocates [batch, kv_heads, capacity, head_dim] at the prefill and writes
each step's keys/values in place, handing attention a view of the filled positions: same values,
same shapes as `DynamicLayer`, no copy per token. Other layer kinds (sliding windows, indexers)
stay as transformers builds them.

`gather_rows` spreads a prefill made once per distinct prompt to the rows of its samples (a prompt
asked for n samples is prefilled once, as SGLang's prefix cache shares it).

`append_rows` joins a cache prefilled for newcomers to a running batch's (continuous batching):
both sides' filled columns end at the same column, the shorter side's rows gain zero keys and
values on the left, which the caller masks out (`decode_rows.DecodeRows.attention_mask`). Keys are
stored after the rotary embedding of their own position ids, so moving them to other columns
changes nothing the attention sees.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A `DynamicLayer` holding at most `capacity` positions in buffers allocated at the first update."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        batch, heads, _, key_dim = key_states.shape
        self._key_buffer = key_states.new_empty(batch, heads, self.capacity, key_dim)
        self._value_buffer = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.keys, self.values = self._key_buffer[:, :, :0], self._value_buffer[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write [batch, heads, new, dim] after the filled positions; return views of all filled ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} positions; {end} requested")
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.keys.shape[-2] if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (in that order), moved to the front of the same buffers."""
        if not self.is_initialized:
            return
        length, rows = self.keys.shape[-2], len(indices)
        self._key_buffer[:rows, :, :length] = self._key_buffer[indices, :, :length]
        self._value_buffer[:rows, :, :length] = self._value_buffer[indices, :, :length]
        self._key_buffer, self._value_buffer = self._key_buffer[:rows], self._value_buffer[:rows]
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]

    def gather_rows(self, index: torch.Tensor) -> None:
        """Row i becomes a copy of row `index[i]` (rows may repeat), in new buffers of the same capacity."""
        length = self.keys.shape[-2]
        self._key_buffer, self._value_buffer = self._key_buffer[index], self._value_buffer[index]
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]

    def append_rows(self, other: PreallocatedLayer, capacity: int) -> None:
        """Rows of `other` after this layer's, both ending at the longer filled length, in new
        buffers of `capacity` positions; the columns left of a side's own are zeros."""
        rows, length = self.keys.shape[0], max(self.keys.shape[-2], other.keys.shape[-2])
        if length > capacity:
            raise ValueError(f"KV cache of {capacity} positions cannot hold {length}")
        buffers = []
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            heads, dim = mine.shape[1], mine.shape[-1]
            buffer = mine.new_empty(rows + theirs.shape[0], heads, capacity, dim)
            for part, source in ((buffer[:rows], mine), (buffer[rows:], theirs)):
                start = length - source.shape[-2]
                part[:, :, :start].zero_()
                part[:, :, start:length].copy_(source)
            buffers.append(buffer)
        self._key_buffer, self._value_buffer = buffers
        self.capacity = capacity
        self.keys, self.values = self._key_buffer[:, :, :length], self._value_buffer[:, :, :length]

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """A `DynamicCache` for `config` whose plain full-attention layers hold `capacity` positions each."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def is_preallocated(cache: DynamicCache) -> bool:
    """Whether every layer of `cache` is a `PreallocatedLayer` (no sliding windows or other kinds)."""
    return all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)


def gather_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Row i of every (filled, preallocated) layer becomes a copy of row `index[i]`: a prefill of each
    distinct prompt once, spread to the rows of its samples."""
    for layer in cache.layers:
        layer.gather_rows(index)


def can_append_rows(cache: DynamicCache) -> bool:
    """Whether every layer of `cache` is a filled `PreallocatedLayer` (others cannot take newcomers)."""
    return all(isinstance(layer, PreallocatedLayer) and layer.is_initialized for layer in cache.layers)


def append_rows(cache: DynamicCache, other: DynamicCache, capacity: int) -> None:
    """Append `other`'s rows to `cache` (both `can_append_rows`), layer by layer (`PreallocatedLayer.append_rows`)."""
    for layer, theirs in zip(cache.layers, other.layers, strict=True):
        layer.append_rows(theirs, capacity)
