"""Building a role's megatron-core `GPTModel` chunks from an HF checkpoint (or a `torch_dist` one).

The HF weights are loaded straight into the sharded model at start-up (weight-mapping.md §7.4):
for each local parameter, its global megatron name gives the bridge rule, the rule reads only the
HF tensors it needs and converts them, and this rank copies in its TP shard. No conversion to
disk is needed. A `torch_dist` checkpoint directory (the bridge converter's output, or any
megatron-saved model) is loaded with `dist_checkpointing`, resharded to this rank's layout
(`checkpoint_io.load_torch_dist_weights`).

The chunks are `HiddenStatesGPTModel`s: their last stage returns the final hidden states (after
the final norm), and `megarl.engines.megatron.heads` applies the output layer or the value head.
megatron-core 0.19 has a public hook for that: `GPTModel.forward(output_processor=...)` calls the
processor with the decoder output instead of applying the output layer, and we pass one that
returns it. megatron-core 0.16 has none: `GPTModel.forward` runs the decoder (whose last stage
applies the final norm) and returns `self._postprocess(hidden_states=..., ...)`, which applies the
output layer; there we override that private method, and `check_postprocess_hook` refuses a
version whose `_postprocess` lost that parameter. A training pass of the MTP layers overrides `_postprocess`
on both lines (megarl's MTP loss, megarl.engines.megatron.mtp). `has_output_processor` picks the way;
tests/engines/test_hidden_states_model.py checks that the output is what megatron's own output
layer would read.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from megarl.bridge import ModelArch, WeightMap, arch_from_hf_config, load_hf_config
from megarl.bridge.convert import HF_ASSETS_DIR
from megarl.bridge.errors import ConversionError
from megarl.bridge.grouped_experts import sequential_expert_name
from megarl.bridge.mapping import EMBEDDING, tp_split
from megarl.bridge.megatron_config import (
    block_spec,
    config_class,
    gpt_model_kwargs,
    layer_spec,
    set_yarn_attributes,
    transformer_config_kwargs,
)
from megarl.bridge.safetensors_io import HFCheckpointReader
from megarl.bridge.moe import expert_index, shift_expert
from megarl.bridge.sharding import expert_split, layer_offset, shard_tp, shift_layer
from megarl.bridge.torch_dist_io import TRACKER_FILE, TorchDistReader
from megarl.config.errors import ConfigError
from megarl.config.expert_mlp import expert_mlp
from megarl.config.rules.mtp import mtp_train_layout_problem
from megarl.config.transformer_overrides import (DTYPE_NAMES, KEY as OVERRIDES_KEY, LAYOUT_NAMES,
                                                cp_comm_type_model_problems)
from megarl.engines.megatron.cp_attention import cpu_reference_attention, with_core_attention
from megarl.engines.megatron.heads import mask_beyond_vocab
from megarl.engines.megatron.mtp import MtpTraining, detach_mtp_inputs, mtp_block_spec, mtp_postprocess
from megarl.engines.megatron.parallel import RoleLayout, compute_device
from megarl.engines.megatron.transformer_overrides import apply_overrides, transformer_config_fields

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VOCAB_MULTIPLE = 128  # megatron's make_vocab_size_divisible_by
VALUE_HEAD = "output_layer.weight"  # the critic's [1, H] head takes the output layer's place
RM_SCORE = "score.weight"  # the [1, H] head of an HF reward model (*ForSequenceClassification)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Rows of the embedding and output layer: the smallest multiple of lcm(128, TP) >= vocab_size.
    For every TP dividing 128 it does not depend on TP, so checkpoints reshard across TP exactly."""
    multiple = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def transformer_engine_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def apex_grad_accumulation_available() -> bool:
    """Whether apex's `fused_weight_gradient_mlp_cuda` extension can be imported: megatron's own
    ColumnParallelLinear refuses `gradient_accumulation_fusion` without it, at construction
    (megatron-core 0.16.1 tensor_parallel/layers.py:924, 0.19.2 :1070), and GPTModel's output layer
    is one even with transformer-engine layers. NGC containers have it; `pip install` has not."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def fusion_flags(*, on_cuda: bool, transformer_engine: bool, lora: bool, trains: bool,
                 apex_grad_accumulation: bool, arch: Optional[ModelArch] = None) -> dict[str, bool]:
    """megatron `TransformerConfig` fusion settings of a role, decided from what is detectable when
    it is built: CUDA, transformer-engine installed (`transformer_engine_available`), LoRA (its roles
    build megatron's local layers, `lora.builds_with_transformer_engine`), whether the role trains,
    and apex's gradient-accumulation kernel (`apex_grad_accumulation_available`).

    Off on CPU, all of them: each is a CUDA kernel (megatron-on-cpu.md §3c: `apply_rope_fusion`
    raises without transformer-engine, `persist_layer_norm` and `gradient_accumulation_fusion`
    raise without apex; the others compile torch kernels for seconds to stand for eager maths),
    and on CPU nothing may change numerically (Megatron log-probs equal HF's, tests/engines).

    On CUDA (Megatron-LM's defaults, megatron/training/arguments.py, where megarl can run them):
    - `bias_activation_fusion`: SwiGLU through megatron's `bias_swiglu_impl` (fusions/fused_bias_swiglu.py,
      `jit_fuser` = torch.compile; no bias is fine, transformer/mlp.py), for the local and the TE
      spec alike; megarl's models are SwiGLU (silu, gated), which TransformerConfig accepts.
    - `bias_dropout_fusion`: the residual add through `bias_dropout_add_fused_*` (torch.compile);
      TEGroupedMLP refuses it only with `add_bias_linear` (moe/experts.py), which only gpt-oss has
      (then it is off, as is `apply_rope_fusion` under YaRN: see the flags below).
    - `apply_rope_fusion`: transformer-engine's fused RoPE (models/common/embeddings/rope_utils.py),
      used by megatron's attention with both specs and both sequence layouts (sbhd and packed thd);
      TransformerConfig raises "apply_rope_fusion is not available" without TE's kernel.
    - `gradient_accumulation_fusion`: TE layers accumulate weight gradients straight into DDP's
      fp32 `main_grad` (extensions/transformer_engine.py `fuse_wgrad_accumulation`), so only with TE
      layers (not LoRA: megatron's local linears, frozen there anyway), only in a trained role (its
      parameters have `main_grad`; forward-only roles have no DDP), and only with apex's kernel
      (the output layer's ColumnParallelLinear raises without it, `apex_grad_accumulation_available`).
    Left off on purpose:
    - `masked_softmax_fusion`: read only by megatron's local attention (transformer/dot_product_attention.py;
      TE attention ignores it), needs apex's `scaled_masked_softmax_cuda` (imported in
      fusions/fused_softmax.py::is_kernel_available on bf16/fp16 inputs, an ImportError without
      apex), and its causal kernel ignores a sliding window (`forward_fused_softmax`).
    - `persist_layer_norm`: apex's persistent LayerNorm kernel (fusions/fused_layer_norm.py);
      megarl's models are RMSNorm, and torch's norm asserts it off (transformer/torch_norm.py).
    - `cross_entropy_loss_fusion`: megatron's LM loss is never computed; megarl's heads compute
      log-probs from the hidden states (heads.py).
    Numerics on GPU: the compiled SwiGLU and TE's RoPE round their intermediates differently from
    the eager ops (fewer bf16 roundings), and fused weight-gradient accumulation sums in fp32
    main_grad: bf16 log-probs differ from the unfused (and HF) ones by rounding, not bit for bit
    (GPU kernels never matched HF bit for bit; the exactness tests run on CPU, where all are off).
    The actor and the reference get the same forward flags (only `gradient_accumulation_fusion`,
    backward only, follows `trains`), so at step 0 their log-probs still agree exactly on the same
    layer spec."""
    te_layers = transformer_engine and not lora
    yarn = arch is not None and arch.rope_scaling is not None and arch.rope_scaling.kind == "yarn"
    biased = arch is not None and arch.linear_bias
    return {
        # gpt-oss (`arch`): megatron's fused RoPE for packed (thd) sequences drops YaRN's concentration
        # factor (models/common/embeddings/rope_utils.py `apply_rotary_pos_emb`: only the sbhd path falls
        # back to the unfused maths when mscale != 1), and TEGroupedMLP refuses bias_dropout_fusion with
        # biased linears (transformer/moe/experts.py:529)
        "bias_activation_fusion": on_cuda,
        "bias_dropout_fusion": on_cuda and not biased,
        "apply_rope_fusion": on_cuda and transformer_engine and not yarn,
        "gradient_accumulation_fusion": on_cuda and te_layers and trains and apex_grad_accumulation,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "cross_entropy_loss_fusion": False,
    }


def sequence_parallel_problem(sp: bool, *, on_cuda: bool, transformer_engine_layers: bool) -> Optional[str]:
    """Why a role's layers cannot run sequence parallelism here, or None. megatron's local layer
    spec builds every RMSNorm as torch's (models/backends.py:110 `LNImpl = WrappedTorchNorm`), which
    refuses it (transformer/torch_norm.py:32 `assert not config.sequence_parallel`); megarl lifts
    that on the CPU only (the `sequence_parallel_norm` CPU shim, never applied on CUDA), and
    transformer-engine's norms take it (extensions/transformer_engine.py TENorm). So on CUDA only
    transformer-engine layers run it."""
    if sp and on_cuda and not transformer_engine_layers:
        return ("sequence_parallel=true on a GPU needs transformer-engine layers (megatron's local layer spec, "
                "built without transformer-engine installed, refuses it: transformer/torch_norm.py); install "
                "transformer-engine or set sequence_parallel=false")
    return None


def core_attention_choice(cp: int, *, packed: bool, on_cuda: bool, transformer_engine_layers: bool,
                          mla: bool = False) -> Optional[str]:
    """The core attention of a role's layers at context parallel size `cp`, with packed (THD)
    sequences or not: "spec" (the layer spec's own), "cpu_reference"
    (`cp_attention.CpuReferenceAttention`), or None (none can run it here). Rules: transformer-engine's
    attention runs CP itself, with megatron's `cp_comm_type` (extensions/transformer_engine.py
    TEDotProductAttention: cp_group, cp_global_ranks, cp_stream, and "p2p" where the type is unset),
    and packed sequences (`PackedSeqParams`); megatron's local attention refuses both
    (transformer/dot_product_attention.py:57 "Context parallelism is only supported by
    TEDotProductAttention!", and `assert packed_seq_params is None`), so without transformer-engine
    layers the CPU takes megarl's reference, and a GPU none (a reference attention materialises
    [rows/CP, rows] scores per head). On the CPU the reference serves plain causal rows too (CP 1,
    not packed), through torch's fused `scaled_dot_product_attention`, as HF's models do there:
    megatron's local attention computes them unfused (baddbmm, masked softmax, bmm), which made the
    quickstart's update 5-7% slower (docs/benchmarks.md, issue 50). Multi-latent attention (`mla`)
    hands its core attention separate key and value head dims (`k_channels`, `v_channels`:
    multi_latent_attention.py), which megatron's local DotProductAttention does not take: without
    transformer-engine layers the CPU takes the reference, a GPU none."""
    if transformer_engine_layers or (on_cuda and cp == 1 and not packed and not mla):
        return "spec"
    return None if on_cuda else "cpu_reference"


def attention_sinks_problem(softmax_type: str, *, attention: str, transformer_engine_layers: bool,
                            te_version: Optional[str]) -> Optional[str]:
    """Why the core attention `core_attention_choice` picked cannot run `softmax_type` (gpt-oss's
    sinks are "learnable"), or None. megarl's `CpuReferenceAttention` takes it; megatron's local
    `DotProductAttention` takes it (its `softmax_offset` goes to `FusedScaleMaskSoftmax`, which then
    skips the fused kernel for the torch softmax with `SoftmaxOne`: fusions/fused_softmax.py:233);
    transformer-engine's `TEDotProductAttention` passes it to transformer-engine, which megatron-core
    requires to be >= 2.8.0 (extensions/transformer_engine.py:1283, `assert is_te_min_version("2.8.0")`;
    transformer-engine then runs it with its cuDNN fused attention)."""
    if softmax_type == "vanilla" or attention == "cpu_reference" or not transformer_engine_layers:
        return None
    from packaging.version import Version

    if te_version is None or Version(te_version) < Version("2.8.0"):
        return (f"softmax_type={softmax_type!r} (attention sinks) with transformer-engine layers needs "
                f"transformer-engine >= 2.8.0 (megatron-core extensions/transformer_engine.py), found {te_version}")
    return None


def te_version() -> Optional[str]:
    """The installed transformer-engine's version, None without it."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("transformer-engine", "transformer_engine"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return None


def te_grouped_linear_available() -> bool:
    """megatron-core defines `TEColumnParallelGroupedLinear` (transformer-engine >= 1.9 installed),
    which grouped-GEMM experts need (`megarl.config.expert_mlp`)."""
    from megatron.core.extensions import transformer_engine as te_extensions

    return getattr(te_extensions, "TEColumnParallelGroupedLinear", None) is not None


@dataclass(frozen=True)
class ModelSource:
    """Where a role's weights come from: an HF directory, or a `torch_dist` checkpoint whose
    iteration directory holds the HF config in `hf/` (as the bridge converter writes it)."""

    path: Path
    kind: str  # "hf" or "torch_dist"
    config_dir: Path  # holds config.json

    @classmethod
    def resolve(cls, path: str | Path, key: str) -> "ModelSource":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"{key}={str(path)!r}: not a directory (an HF or a torch_dist checkpoint)")
        if (path / TRACKER_FILE).is_file() or (path / "metadata.json").is_file():
            reader = TorchDistReader(path)
            if not (reader.dir / HF_ASSETS_DIR / "config.json").is_file():
                raise FileNotFoundError(
                    f"{key}={str(path)!r}: a torch_dist checkpoint without {HF_ASSETS_DIR}/config.json in "
                    f"{reader.dir}; convert it with `megarl convert` or point to an HF directory"
                )
            return cls(reader.dir, "torch_dist", reader.dir / HF_ASSETS_DIR)
        return cls(path, "hf", path)

    @classmethod
    def dist_checkpoint(cls, path: str | Path, key: str, config_dir: Path) -> "ModelSource":
        """verl's `use_dist_checkpointing`: the weights from the `torch_dist` directory `path`
        (megatron's own save of a GPTModel, no HF files inside), the config from `config_dir`."""
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{key}={str(path)!r}: not a directory (a megatron-core torch_dist checkpoint)")
        return cls(TorchDistReader(path).dir, "torch_dist", config_dir)


def read_arch(source: ModelSource, override_config: Mapping[str, Any], key: str) -> ModelArch:
    """The `ModelArch` of a checkpoint's config.json with `override_config` applied."""
    hf_config = load_hf_config(source.config_dir)
    hf_config.update(override_config)
    return arch_from_hf_config(hf_config, source=f"{source.config_dir / 'config.json'} ({key})")


def has_output_processor(gpt_model_class) -> bool:
    """Whether `GPTModel.forward` takes the public `output_processor` hook (megatron-core >= 0.19)."""
    return "output_processor" in inspect.signature(gpt_model_class.forward).parameters


def check_postprocess_hook(gpt_model_class) -> None:
    """Raise unless `gpt_model_class._postprocess` takes the decoder output as `hidden_states`
    (its first parameter), which the 0.16 `HiddenStatesGPTModel` relies on."""
    from megarl.engines.megatron.cpu.shims import megatron_core_version

    method = getattr(gpt_model_class, "_postprocess", None)
    params = list(inspect.signature(method).parameters)[:2] if callable(method) else None
    if params != ["self", "hidden_states"]:
        found = "no _postprocess" if params is None else f"_postprocess{inspect.signature(method)}"
        raise RuntimeError(
            f"megatron-core {megatron_core_version()}: GPTModel has {found} and no forward(output_processor=...), "
            "but megarl's HiddenStatesGPTModel overrides _postprocess(self, hidden_states, **kwargs) to return the "
            "final hidden states (as megatron-core 0.16.1 defines it); adapt megarl.engines.megatron.model to this version"
        )


def whole_sequence(hidden_states: torch.Tensor, config) -> torch.Tensor:
    """The final hidden states [s, b, H] of the whole sequence. With sequence parallelism the
    decoder returns this rank's s/TP positions (megatron's output layer would all-gather them,
    tensor_parallel/layers.py ColumnParallelLinear): all-gathered over the TP group here. Backward:
    this rank's positions of the gradient, which must then be whole on every TP rank, as the heads
    make it (heads.py: the log-prob head all-reduces its vocabulary shards' parts; the value head
    computes the same values on every rank)."""
    if not config.sequence_parallel:
        return hidden_states
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)


def _return_hidden_states(*, hidden_states, config, **_):
    """megatron-core's `output_processor`: the decoder output [s, b, H] of the whole sequence (with an MTP
    block, megatron's `process_mtp_loss` has attached its loss to it: megarl.engines.megatron.mtp)."""
    return whole_sequence(hidden_states, config)


def _gpt_model_class():
    from megatron.core.models.gpt.gpt_model import GPTModel

    class UnpaddedLossGPTModel(GPTModel):
        """megatron's `GPTModel` whose cross-entropy (here only the MTP loss's: megarl.engines.megatron.mtp)
        masks megatron's vocabulary padding, the columns from `vocab_size_unpadded` (the checkpoint's
        vocabulary, set by `build_chunks`) on, to -inf as megarl's heads do; megatron's softmax would count them."""

        vocab_size_unpadded: Optional[int] = None

        def compute_language_model_loss(self, labels, logits):
            if self.vocab_size_unpadded is not None:  # logits [s, b, V/TP]: this rank's vocabulary shard
                logits = mask_beyond_vocab(logits, self.vocab_size_unpadded)
            return super().compute_language_model_loss(labels, logits)

    if has_output_processor(GPTModel):

        class HiddenStatesGPTModel(UnpaddedLossGPTModel):
            """A `GPTModel` whose last stage returns the final hidden states [s, b, H] (after the
            final norm) instead of logits, through megatron-core's public `output_processor`
            hook; the output layer stays a parameter holder that the heads use."""

            def forward(self, *args, **kwargs):
                return super().forward(*args, output_processor=_return_hidden_states, **kwargs)

            def _postprocess(self, hidden_states, **kwargs):
                # a training pass of the MTP layers: megarl's MTP loss (megarl.engines.megatron.mtp), not
                # megatron's `process_mtp_loss`, whose normaliser is wrong with context parallelism; GPTModel.forward
                # passes every argument by name
                if self.mtp_process and kwargs.get("labels") is not None:
                    return whole_sequence(mtp_postprocess(self, hidden_states, kwargs), self.config)
                return super()._postprocess(hidden_states, **kwargs)

        return HiddenStatesGPTModel

    check_postprocess_hook(GPTModel)

    class HiddenStatesGPTModel(UnpaddedLossGPTModel):
        """A `GPTModel` whose last stage returns the final hidden states [s, b, H] (after the
        final norm) instead of logits; the output layer stays a parameter holder that the heads
        use. (Overrides the private `GPTModel._postprocess` of megatron-core 0.16; see the module docstring.)"""

        def _postprocess(self, hidden_states, **kwargs):
            if self.mtp_process and kwargs.get("labels") is not None:  # a training pass of the MTP layers
                hidden_states = mtp_postprocess(self, hidden_states, kwargs)
            return whole_sequence(hidden_states, self.config)

    return HiddenStatesGPTModel


def build_chunks(
    arch: ModelArch,
    layout: RoleLayout,
    *,
    vocab_rows: int,
    params_dtype: torch.dtype,
    value_head: bool,
    transformer_engine: bool,
    packed: bool = False,
    moe_settings: Optional[dict] = None,
    fusions: Optional[dict] = None,
    overrides: Optional[Mapping[str, Any]] = None,
    section: str = "",
    mtp: Optional[MtpTraining] = None,
) -> tuple[list[torch.nn.Module], Any]:
    """This rank's model chunks (one per virtual stage) with uninitialised weights, and their
    megatron `TransformerConfig`. With `value_head`, the last chunk's output layer is a [1, H] head.
    `packed`: the role runs packed (THD) sequences (`core_attention_choice`). `moe_settings`: extra `TransformerConfig` arguments of an MoE model (`moe_settings()`);
    `fusions`: `fusion_flags()` (None: megatron's defaults, all off); `overrides`: the role's
    `TransformerConfig` fields on top (`megarl.config.transformer_overrides.role_overrides`: its
    `<section>.megatron.override_transformer_config` and recompute), checked by
    `transformer_overrides.apply_overrides`: what megarl derives may not change, fusions may.
    `mtp`: the last chunk holds the checkpoint's `arch.mtp_layers` multi-token-prediction layers, trained
    (megarl.engines.megatron.mtp)."""
    from megatron.core import parallel_state

    if mtp is not None:
        problem = mtp_train_layout_problem(layout.vpp, section)
        if problem:
            raise ConfigError(problem)

    kwargs = transformer_config_kwargs(arch, layout.bridge_layout, params_dtype)
    kwargs.update(
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,  # every weight is loaded
        # 1F1B: micro-batches differ in shape, and p2p sends each shape first. Interleaved (VPP):
        # micro-batches are padded to one shape and p2p is unbatched, because with PP=2 (both
        # neighbours the same rank) megatron's batched sends pair messages wrongly on gloo.
        variable_seq_lengths=layout.pp > 1 and layout.vpp == 1,
        batch_p2p_comm=layout.vpp == 1,
        moe_token_dispatcher_type="alltoall",  # unused (dense model); the default refuses variable lengths
        sequence_parallel=layout.sp,
        context_parallel_size=layout.cp,
    )
    kwargs.update(moe_settings or {})
    if mtp is not None:
        kwargs["mtp_num_layers"] = arch.mtp_layers
    derived = dict(kwargs)
    kwargs.update(fusions or {})
    if mtp is not None:  # an override_transformer_config value wins, as in verl's check_mtp_config
        kwargs["mtp_loss_scaling_factor"] = mtp.loss_scaling_factor
    prefix = f"{section}.{OVERRIDES_KEY}"
    overrides = overrides or {}
    kwargs = apply_overrides(kwargs, overrides, prefix=prefix, fields=transformer_config_fields(), derived=derived,
                             sources=derived_sources(section))
    try:
        config = set_yarn_attributes(config_class(arch)(**kwargs), arch)  # MLATransformerConfig for MLA
    except (ValueError, AssertionError) as refused:  # megatron-core's own checks (__post_init__)
        if not overrides:
            raise
        raise ConfigError(f"{prefix}: megatron-core's TransformerConfig refuses the settings with the overrides "
                          f"{dict(overrides)}: {refused}") from None
    model_kwargs = gpt_model_kwargs(arch, vocab_rows)
    if value_head:
        model_kwargs["share_embeddings_and_output_weights"] = False
    model_class = _gpt_model_class()
    spec = layer_spec(arch, transformer_engine, grouped_gemm=config.moe_grouped_gemm)
    dense_spec = layer_spec(arch, transformer_engine, dense=True)  # the dense first layers of an MoE model
    attention = core_attention_choice(layout.cp, packed=packed, on_cuda=torch.cuda.is_available(),
                                      transformer_engine_layers=transformer_engine, mla=arch.mla is not None)
    if attention is None and arch.mla is not None:
        raise ValueError(f"{section}: multi-latent attention ({arch.model_type}) on a GPU needs transformer-engine "
                         "layers (megatron's local DotProductAttention takes no separate key and value head dims); "
                         "install transformer-engine (LoRA roles build local layers: no LoRA of MLA models on GPUs)")
    if attention is None:
        raise ValueError(f"{section}.megatron.context_parallel_size={layout.cp} on a GPU needs transformer-engine "
                         "layers (megatron's local attention refuses context parallelism and packed sequences, "
                         "transformer/dot_product_attention.py); install transformer-engine (LoRA roles build local "
                         "layers: no context parallelism with LoRA on GPUs)")
    sinks = attention_sinks_problem(config.softmax_type, attention=attention,
                                    transformer_engine_layers=transformer_engine,
                                    te_version=te_version() if config.softmax_type != "vanilla" else None)
    if sinks:
        raise ValueError(f"{section}: {sinks}")
    if attention == "cpu_reference":
        spec = with_core_attention(spec, cpu_reference_attention())
        dense_spec = with_core_attention(dense_spec, cpu_reference_attention())
    elif layout.cp > 1:  # transformer-engine's CP attention
        problems = cp_comm_type_model_problems(
            prefix, config.cp_comm_type, cp=layout.cp, tp=layout.tp, heads=arch.num_attention_heads,
            query_groups=arch.num_query_groups, sliding_window=arch.sliding_window is not None)
        if problems:
            raise ConfigError("; ".join(problems))
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    device = compute_device()
    chunks = []
    for v in range(layout.vpp):
        last = layout.bridge_layout.is_last(pp_rank, v)
        chunk = model_class(
            config, block_spec(arch, layout.bridge_layout, pp_rank, v, spec, dense_spec), **model_kwargs,
            pre_process=layout.bridge_layout.is_first(pp_rank, v), post_process=last,
            vp_stage=v if layout.vpp > 1 else None,
            mtp_block_spec=mtp_block_spec(config, spec, transformer_engine) if mtp is not None and last else None,
        )
        if mtp is not None and mtp.detach_encoder and last:
            detach_mtp_inputs(chunk)
        chunk.vocab_size_unpadded = arch.vocab_size
        check_experts_built(chunk, config.moe_grouped_gemm)
        reduce_expert_outputs_explicitly(chunk)
        _mark_tensor_parallel(chunk, layout.expert_tp)
        if value_head and last:
            chunk.output_layer = torch.nn.Linear(arch.hidden_size, 1, bias=False, dtype=params_dtype)
        # megatron's local norms (torch.nn.RMSNorm) ignore params_dtype and are created in float32;
        # cast every parameter as megatron's Float16Module does (the rotary inv_freq is no buffer
        # and stays float32)
        chunks.append(chunk.to(device=device, dtype=params_dtype))
    return chunks, config


def derived_sources(section: str) -> dict[str, str]:
    """TransformerConfig name -> the key megarl sets it from, for `section`'s override messages."""
    return {**{name: f"{section}.megatron.{name}" for name in LAYOUT_NAMES},
            **{name: "actor_rollout_ref.model.dtype" for name in DTYPE_NAMES},
            "moe_enable_routing_replay": "actor_rollout_ref.actor.router_replay.mode"}


def moe_settings(arch: ModelArch, megatron_cfg, router_replay: bool, section: str,
                 transformer_engine: bool = False) -> dict:
    """`TransformerConfig` arguments from a role's `megatron` section for an MoE model: the
    load-balancing loss (megatron's "aux_loss" type, `moe_aux_loss_coeff`), the z-loss
    (`moe_z_loss_coeff`), `moe_enable_routing_replay` for routing replay, and `moe_grouped_gemm`
    (`megarl.config.expert_mlp` on this machine; `transformer_engine`: the role builds TE layers).
    A dense model takes none of them; replay on a dense model is refused naming the key."""
    if arch.moe is None:
        if router_replay:
            raise ValueError("actor_rollout_ref.actor.router_replay.mode=R3 needs an MoE model "
                             f"({section}'s model has no experts); set it to disabled")
        return {}
    experts = expert_mlp(megatron_cfg.moe_grouped_gemm, compute_device().type, transformer_engine,
                         transformer_engine and te_grouped_linear_available(), section=section)
    aux = float(megatron_cfg.moe_aux_loss_coeff)
    out: dict = {"moe_enable_routing_replay": router_replay, "moe_grouped_gemm": experts == "grouped"}
    if aux > 0:
        out.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux)
    if megatron_cfg.moe_z_loss_coeff:
        out["moe_z_loss_coeff"] = float(megatron_cfg.moe_z_loss_coeff)
    return out


def reduce_expert_outputs_explicitly(chunk: torch.nn.Module) -> None:
    """Mark biased expert `linear_fc2`s (gpt-oss) whose expert-TP group has one rank as
    communicating explicitly, as megatron does for shared experts (transformer/moe/shared_experts.py:104).
    At EP 1 and expert TP 1 megatron's local `RowParallelLinear` returns its output through
    `reduce_from_tensor_model_parallel_region` (tensor_parallel/layers.py `RowParallelLinear.forward`),
    which hands back its input as a view, and the expert MLP then adds the probability-weighted
    bias in place (transformer/mlp.py:247 `output += output_bias...`), which autograd refuses
    ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace"). Over a
    group of one rank that reduction is the identity, so skipping it changes no value."""
    from megatron.core.parallel_state import get_expert_tensor_parallel_world_size
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    if get_expert_tensor_parallel_world_size() != 1:
        return
    for module in chunk.modules():
        if isinstance(module, RowParallelLinear) and module.is_expert and module.bias is not None:
            module.explicit_expert_comm = True


def check_experts_built(chunk: torch.nn.Module, grouped: bool) -> None:
    """Raise unless every MoE layer of `chunk` holds the expert module decided: megatron falls
    back silently (to the legacy GroupedMLP, or SequentialMLP) where grouped GEMM cannot be built
    (`megarl.config.expert_mlp`)."""
    want = "TEGroupedMLP" if grouped else "SequentialMLP"
    for layer in chunk.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and type(experts).__name__ != want:
            raise RuntimeError(f"layer {layer.layer_number - 1}: megatron-core built {type(experts).__name__} "
                               f"experts, megarl decided {want} (moe_grouped_gemm={grouped})")


def _mark_tensor_parallel(chunk: torch.nn.Module, expert_tp: int) -> None:
    """Tag TP-sharded parameters as megatron's initialisation would (`tensor_model_parallel`,
    `partition_dim`, `partition_stride`). With `perform_initialization=False` megatron-core 0.16
    skips the tagging, and untagged shards count only on TP rank 0 in the gradient norm. Experts
    are sharded only when the expert TP size is above 1. Grouped-GEMM experts come tagged by
    transformer-engine (in megatron-core 0.16.1 with partition_dim 0 for fc2 too, since megatron hands
    TE no parallel mode when it shards experts itself): with expert TP > 1 the bridge's split replaces it."""
    for name, param in chunk.named_parameters():
        split = tp_split(name)
        if split.dim is not None and (expert_index(name) is None or expert_tp > 1):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, split.dim, 1


EXPERT_BIAS = ".mlp.router.expert_bias"  # DeepSeek-V3's selection bias: a buffer, loaded from HF like a weight


def _local_params(chunks, layout: RoleLayout, num_layers: int):
    """(local name, global name, parameter) of every parameter of this rank's chunks, and of every
    router's `expert_bias` buffer (HF `e_score_correction_bias`: it routes, so it must be loaded, but
    megatron keeps it out of the parameters); an expert's global name has its global expert index,
    spelled as SequentialMLP names it (grouped GEMM too)."""
    from megatron.core import parallel_state

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    experts_here = None
    for v, chunk in enumerate(chunks):
        offset = layer_offset(num_layers, layout.bridge_layout, pp_rank, v)
        biases = [(n, b) for n, b in chunk.named_buffers() if n.endswith(EXPERT_BIAS)]
        for name, param in [*chunk.named_parameters(), *biases]:
            global_name = shift_layer(sequential_expert_name(name), offset)  # grouped-GEMM experts renamed
            if expert_index(name) is not None:
                experts_here = experts_here or chunk.config.num_moe_experts // layout.ep
                global_name = shift_expert(global_name, ep_rank * experts_here)
            yield name, global_name, param


def load_hf_weights(chunks, weights: WeightMap, layout: RoleLayout, hf_dir: Path, value_head: bool, seed: int) -> None:
    """Copy this rank's shard of every parameter from the HF checkpoint `hf_dir`.

    A value head is read from the reward model's `score.weight` when the checkpoint has a [1, H]
    one, else drawn from N(0, 0.02) with `seed` (the same on every rank)."""
    from megatron.core import parallel_state

    tp, tp_rank = layout.tp, parallel_state.get_tensor_model_parallel_rank()
    with HFCheckpointReader(hf_dir) as reader:
        names = set(reader.names())
        if value_head:
            names -= {RM_SCORE}
        weights.check_hf_names(names, source=str(hf_dir))
        for local, name, param in _local_params(chunks, layout, weights.arch.num_layers):
            if value_head and local == VALUE_HEAD:
                shard = _value_head_init(reader, param.shape, seed)
            else:
                source = EMBEDDING if weights.is_tied_output_copy(name) else weights.canonical(name)
                split = expert_split(weights, layout.bridge_layout, source)
                shard = shard_tp(split, weights.to_mcore(source, reader.read), tp, tp_rank)
            if tuple(shard.shape) != tuple(param.shape):
                raise ConversionError(
                    f"{hf_dir}: {name} has shape {list(shard.shape)} for this rank, the model wants {list(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(shard)


def _value_head_init(reader: HFCheckpointReader, shape: torch.Size, seed: int) -> torch.Tensor:
    if RM_SCORE in reader.names() and reader.shape(RM_SCORE) == tuple(shape):
        return reader.read(RM_SCORE)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=generator) * 0.02


def vocab_rows_of(source: ModelSource, arch: ModelArch, tp: int) -> int:
    """Padded vocabulary of the model: from the checkpoint for torch_dist, else `padded_vocab`."""
    if source.kind == "hf":
        return padded_vocab(arch.vocab_size, tp)
    rows = TorchDistReader(source.path).shape(EMBEDDING)[0]
    if rows % tp or rows < arch.vocab_size:
        raise ConversionError(f"{source.path}: embedding of {rows} rows cannot be split over TP={tp}")
    return rows


def backbone_arch(arch: ModelArch) -> ModelArch:
    """The arch without an LM output layer or score head (the critic replaces it by a value
    head): HF `lm_head.weight`, if present, is ignored; a reward model's `score.weight` is read
    by `load_hf_weights` as the value head."""
    return dataclasses.replace(arch, tie_word_embeddings=True, score_head=False)
