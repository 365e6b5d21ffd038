"""LoRA adapters on megatron-core's linear layers, tensor-parallel, with the base weights frozen.

`attach_lora` freezes every parameter of the model chunks and puts one `LoraAdapter` beside each
targeted linear layer (`linear_qkv_lora` next to `linear_qkv`, ...; names in megarl.bridge.lora).
A forward hook on the base layer adds the adapter's output to the layer's: y = W x + s B A x,
s = alpha / rank. Only adapter parameters require gradients, so megatron's DDP allocates gradient
buffers (and all-reduces) for them alone and its optimizer holds only them.

TP (megatron's column- and row-parallel maths, applied to the adapter):
- column-parallel base (linear_qkv, linear_fc1): the input x is whole on every rank and each rank
  computes its rows of the output. A [r, in] is whole, B [out/TP, r] holds this rank's rows.
  h = A x goes through `copy_to_tensor_model_parallel_region` (identity forward, all-reduce of
  dL/dh backward), because every rank's rows of B contribute to dL/dh; then A's gradient is the
  full one on every rank (A stays identical) and dL/dx through the adapter is complete.
- row-parallel base (linear_proj, linear_fc2): x holds this rank's slice of the input and the
  output is all-reduced. A [r, in/TP] holds this rank's columns, B [out, r] is whole.
  h = A x is a partial sum: `reduce_from_tensor_model_parallel_region` (all-reduce forward,
  identity backward) completes it before B.
Fused layers: q/k/v adapters fill their rows of megatron's per-query-group QKV output ([q heads of
group g, k_g, v_g] per local group); gate/up adapters fill fc1's two halves [gate_local; up_local].

Initialisation follows PEFT: B = 0 (the model starts equal to the base, exactly), A uniform in
+-1/sqrt(in) (kaiming-uniform, a = sqrt(5)), or with `init_A="xavier"` as Megatron-Bridge's LoRA
(verl's Megatron default) draws it: torch's xavier_normal_, N(0, 2 / (in + r)). A is drawn whole
from a generator seeded by the seed and the adapter's global name, then sharded: every TP/PP
layout starts from the same adapters (Megatron-Bridge's GPU initialisation draws each TP shard
with the shard's own fans: the same at TP 1).

Only megatron's local linear layers (no transformer-engine fusion of the input norm into
linear_qkv / linear_fc1) are supported: `attach_lora` refuses anything else by name.
"""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from megarl.bridge import ModelArch
from megarl.bridge.lora import SUFFIX, TARGETS, AdapterName
from megarl.bridge.sharding import shard_tp


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]  # PEFT names
    dropout: float = 0.0  # on the adapter's input, in training passes only (PEFT's lora_dropout)
    init_A: str = "kaiming"  # "kaiming" | "xavier": see the module's docstring

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def full_shape(arch: ModelArch, target: str) -> tuple[int, int]:
    """(out, in) of the HF projection `target`."""
    nh, ng, d = arch.num_attention_heads, arch.num_query_groups, arch.kv_channels
    h, f = arch.hidden_size, arch.ffn_hidden_size
    return {"q_proj": (nh * d, h), "k_proj": (ng * d, h), "v_proj": (ng * d, h), "o_proj": (h, nh * d),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}[target]


def initial_factor(name: AdapterName, arch: ModelArch, rank: int, seed: int, init_A: str = "kaiming") -> torch.Tensor:
    """The full float32 factor at initialisation: B [out, r] = 0; A [r, in] ~ U(-1/sqrt(in), 1/sqrt(in))
    (kaiming), or N(0, 2 / (in + r)) (xavier: Megatron-Bridge's `ParallelLinearAdapter._get_init_fn`
    gives nn.init.xavier_normal_, which reads fan_in = in, fan_out = r from A's shape)."""
    out, inp = full_shape(arch, name.target)
    if name.factor == "B":
        return torch.zeros(out, rank)
    generator = torch.Generator().manual_seed(seed + zlib.crc32(name.mcore.encode()))
    if init_A == "xavier":
        return torch.nn.init.xavier_normal_(torch.empty(rank, inp), generator=generator)
    if init_A != "kaiming":
        raise ValueError(f"LoRA A init {init_A!r}: kaiming or xavier")
    bound = inp ** -0.5
    return (torch.rand(rank, inp, generator=generator) * 2 - 1) * bound


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron linear layer (`kind`: "qkv", "fc1" or "row"), this rank's shards.
    Parameters `<target>_A`, `<target>_B`; `forward(x)` returns s x B A x in the base's local output
    layout [..., out_local]."""

    def __init__(self, kind: str, layer: int, targets: Sequence[str], spec: LoraSpec, arch: ModelArch,
                 tp: int, tp_rank: int, seed: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.kind, self.targets, self.scale, self.layer = kind, tuple(targets), spec.scale, layer
        self.dropout = spec.dropout
        self.arch, self.tp = arch, tp
        self.splits = {}
        for target in self.targets:
            for factor in "AB":
                name = AdapterName(layer, target, factor)
                shard = shard_tp(name.tp, initial_factor(name, arch, spec.rank, seed, spec.init_A), tp, tp_rank)
                param = torch.nn.Parameter(shard.to(device=device, dtype=dtype).contiguous())
                if name.tp.dim is not None:  # as megatron tags its own TP shards (grad-norm counting)
                    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, name.tp.dim, 1
                self.register_parameter(f"{target}_{factor}", param)
                self.splits[f"{target}_{factor}"] = name.tp

    def factors(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{target}_A"), getattr(self, f"{target}_B")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.kind == "row":
            a, b = self.factors(self.targets[0])
            return F.linear(reduce_from_tensor_model_parallel_region(F.linear(self._drop(x), a)), b) * self.scale
        parts = {}
        for target in self.targets:
            a, b = self.factors(target)
            parts[target] = F.linear(copy_to_tensor_model_parallel_region(F.linear(self._drop(x), a)), b)
        return self._assemble(parts, x) * self.scale

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        """PEFT's lora_dropout, one mask per target, in training passes only (the engine's
        log-prob passes run in eval mode: exact). The mask comes from the default generator,
        which megatron seeds alike on every TP rank: a column-parallel base's whole input gets
        the same mask on every rank, as its rows of B need; a row-parallel base's slices get
        masks drawn alike per rank (each element still dropped with probability p)."""
        return F.dropout(x, self.dropout, training=True) if self.dropout > 0 and self.training else x

    def delta_weight(self) -> torch.Tensor:
        """s B A [out_local, in_local] in float32: what merging adds to this rank's base weight."""
        if self.kind == "row":
            a, b = self.factors(self.targets[0])
            return (b.float() @ a.float()) * self.scale
        parts = {t: (self.factors(t)[1].float() @ self.factors(t)[0].float()).T for t in self.targets}  # [in, out_p]
        like = next(iter(parts.values()))
        return self._assemble(parts, like).T * self.scale

    def _assemble(self, parts: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Per-target outputs [..., out_p_local] -> the base's local layout [..., out_local]
        (zeros for targets without an adapter)."""
        lead = like.shape[:-1]
        a = self.arch
        if self.kind == "fc1":
            f = a.ffn_hidden_size // self.tp
            return torch.cat([parts.get(t, like.new_zeros(*lead, f)) for t in ("gate_proj", "up_proj")], dim=-1)
        groups, d = a.num_query_groups // self.tp, a.kv_channels
        widths = {"q_proj": a.num_attention_heads // a.num_query_groups * d, "k_proj": d, "v_proj": d}
        pieces = [parts[t].reshape(*lead, groups, w) if t in parts else like.new_zeros(*lead, groups, w)
                  for t, w in widths.items()]
        return torch.cat(pieces, dim=-1).reshape(*lead, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Checkpoint entries: the TP-split factors as TP-sharded tensors (megatron's default would
        call every child tensor replicated), the whole factors as replicas over TP.

        Both groups are passed, as megatron's own linear layers pass theirs: given a `dp_cp_group`
        alone, `make_sharded_tensors_for_checkpoint` takes TP rank 0 on every TP rank (its
        `get_pg_rank(None)`), so every TP rank claimed the main replica of a whole factor; rank 0's
        sharding validation then raised while the other ranks went on into the save's collectives
        (the LoRA TP2 checkpoint hang)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {name: split.dim for name, split in self.splits.items() if split.dim is not None}
        dp_cp_group = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=dp_cp_group,
        )


def builds_with_transformer_engine(te_available: bool, local_linears: bool) -> bool:
    """Whether a role's layers are transformer-engine's. TE fuses the input norm into linear_qkv /
    linear_fc1 (its LayerNormColumnParallelLinear), whose input is then the un-normalised hidden
    state the adapter must not see: a LoRA role uses megatron's local layer spec, on GPUs too
    (`local_linears`), and so does a QAT actor, whose linears' forward must multiply by the weight
    megarl.engines.megatron.qat hands them (TE's modules read their weights themselves)."""
    return te_available and not local_linears


KINDS = {"self_attention.linear_qkv": "qkv", "mlp.linear_fc1": "fc1",
         "self_attention.linear_proj": "row", "mlp.linear_fc2": "row"}


def refuse_expert_targets(arch: ModelArch, targets: Sequence[str]) -> None:
    """Raise when `targets` name MLP projections of a mixture-of-experts model: its MLP is a router
    and expert MLPs (megatron's MoELayer has no linear_fc1 / linear_fc2 of its own), which megarl's
    LoRA does not adapt."""
    mlp = [t for t in targets if TARGETS[t][0].startswith("mlp.")]
    if arch.moe is not None and mlp:
        raise NotImplementedError(
            f"actor_rollout_ref.model.lora.target_modules: {mlp} would adapt the experts of a mixture-of-experts "
            f"model ({arch.moe.num_experts} experts per layer), which megarl's LoRA does not do yet; target the "
            "attention projections only: [q_proj, k_proj, v_proj, o_proj]"
        )


def attach_lora(chunks: Sequence[torch.nn.Module], arch: ModelArch, spec: LoraSpec, tp: int, tp_rank: int,
                seed: int, dtype: torch.dtype, device: torch.device) -> list[tuple[LoraAdapter, torch.nn.Module]]:
    """Freeze every parameter of `chunks` and add the adapters of `spec.targets` to every layer.
    Returns (adapter, base linear layer) pairs."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    refuse_expert_targets(arch, spec.targets)

    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    attached = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            index = layer.layer_number - 1  # global layer index
            for path, kind in KINDS.items():
                targets = [t for t in spec.targets if TARGETS[t][0] == path]
                if not targets:
                    continue
                parent_name, attr = path.split(".")
                parent = getattr(layer, parent_name)
                base = getattr(parent, attr)
                wanted = RowParallelLinear if kind == "row" else ColumnParallelLinear
                if type(base) is not wanted:
                    raise NotImplementedError(
                        f"actor_rollout_ref.model.lora: layer {index} {path} is a {type(base).__name__}; megarl's "
                        f"LoRA adapts megatron's local {wanted.__name__} only (transformer-engine layers fuse the "
                        "input norm into linear_qkv / linear_fc1, which the adapter would have to reproduce)"
                    )
                adapter = LoraAdapter(kind, index, targets, spec, arch, tp, tp_rank, seed, dtype, device)
                parent.add_module(attr + SUFFIX, adapter)
                base.register_forward_hook(_add_adapter_output(adapter))
                attached.append((adapter, base))
    return attached


def unfreeze_value_head(chunks: Sequence[torch.nn.Module]) -> None:
    """A LoRA critic: its value head (the last stage's [1, H] `output_layer`, new to the model)
    trains whole beside the adapters; `attach_lora` froze it with the base."""
    for chunk in chunks:
        head = getattr(chunk, "output_layer", None)
        if isinstance(head, torch.nn.Linear) and head.out_features == 1:
            head.weight.requires_grad_(True)


def _add_adapter_output(adapter: LoraAdapter):
    def hook(module, args, output):
        out, bias = output
        return out + adapter(args[0]).to(out.dtype), bias

    return hook


@contextmanager
def merged(attached: Sequence[tuple[LoraAdapter, torch.nn.Module]]) -> Iterator[None]:
    """Inside: every adapted base weight holds W + s B A (cast to its dtype), and the adapters
    add nothing (their hooks would count them twice, so do not run the model here; this is for
    reading the weights: the weight push, an HF export). After: the exact original weights."""
    saved = []
    with torch.no_grad():
        try:
            for adapter, base in attached:
                saved.append((base.weight, base.weight.detach().clone()))
                base.weight.copy_((base.weight.float() + adapter.delta_weight()).to(base.weight.dtype))
            yield
        finally:
            for weight, original in saved:
                weight.copy_(original)
