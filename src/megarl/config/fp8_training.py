"""FP8 training as megatron-core runs it: a role's `megatron.override_transformer_config.fp8`
(verl's key; megatron-core's `TransformerConfig.fp8`, "e4m3" or "hybrid") with its `fp8_recipe`.
Pure: the caller passes what it knows of the machine.

How it runs (megatron-core 0.16.1 and 0.19.2): `TransformerBlock.forward` enters
`fp8_utils.get_fp8_context(config)`, transformer-engine's `fp8_autocast` with the recipe
`get_fp8_recipe` makes from `fp8` and `fp8_recipe`; the weights stay in the model dtype and
transformer-engine's linear layers run their GEMMs in FP8. So FP8 needs transformer-engine layers:
without transformer-engine, `get_fp8_context` is a `nullcontext()` (fp8_utils.py, the `else` branch
of `if HAVE_TE`), and megatron's local layers (megarl's spec without transformer-engine, and every
LoRA role, `lora.builds_with_transformer_engine`) have no FP8 GEMM: the run would train in bf16
while saying FP8. Both are refused here rather than ignored. The GPU's own rule is
transformer-engine's (`transformer_engine/pytorch/quantization.py`, asserted when `fp8_autocast` is
entered: `FP8GlobalStateManager.autocast_enter`), `fp8_device_problem` below.

`fp8_param` (FP8 parameters, `fp8_model_init`) is refused: transformer-engine then makes the GEMM
weights `QuantizedTensor`s (megatron-core `fp8_utils.is_float8tensor`), and megarl's weight paths
take every parameter as a plain tensor: `engines.megatron.model.build_chunks` casts the chunks with
`Module.to(dtype)`, `load_hf_weights` copies the HF shards in with `param.copy_`, and the weight push
(`sync.resharder`, `param.detach()` gathered over torch.distributed) would send the FP8 payload
without its scales instead of `dequantize()`d values (`fp8_utils.dequantize_fp8_tensor`). verl's
scripts train with `fp8` and `fp8_recipe` only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

# megatron-core's TransformerConfig field types (transformer_config.py:429-438 in 0.16.1): dataclass
# Literals, which nothing checks when the config is made; a wrong value fails in the first forward
# (`get_fp8_recipe`: "E4M3 and HYBRID are the only supported FP8 formats.")
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
DEFAULT_RECIPE = "delayed"  # TransformerConfig.fp8_recipe's default
# the transformer-engine version megatron-core's `get_fp8_recipe` needs for a recipe (fp8_utils.py,
# 0.16.1: Float8CurrentScaling >= 2.2.0.dev0, Float8BlockScaling >= 2.3.0.dev0; below 2.1.0 only delayed)
TE_MIN_VERSION = {"tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0", "custom": "2.1.0"}
FP8_PARAM_REASON = ("megarl keeps the trained weights as plain tensors (model build, HF load and the weight push "
                    "read them as such; transformer-engine's FP8 parameters would be pushed without their scales); "
                    "fp8 with fp8_recipe trains in FP8 GEMMs with the weights in actor_rollout_ref.model.dtype")


def fp8_format(overrides: Mapping[str, Any]) -> Optional[str]:
    """The FP8 format a role's override_transformer_config asks for, None for none. megatron-core tests
    `if self.fp8:` (transformer_config.py, `__post_init__`; fp8_utils.get_fp8_context), so a false value
    (verl scripts write `fp8=False`) is off."""
    value = overrides.get("fp8")
    return value if value else None


def fp8_value_problems(prefix: str, overrides: Mapping[str, Any]) -> list[str]:
    """Messages for the FP8 names of a role's override_transformer_config (`prefix`: its key path):
    `fp8` one of FP8_FORMATS (or off), `fp8_recipe` one of FP8_RECIPES, no `fp8_param`
    (FP8_PARAM_REASON). megatron-core's own rules (fp8_param without fp8; custom without
    fp8_quantizer_factory) are its TransformerConfig's, checked when the engine builds it."""
    problems = []
    fmt = fp8_format(overrides)
    if fmt is not None and fmt not in FP8_FORMATS:
        problems.append(f"{prefix}.fp8={fmt}: must be one of {', '.join(FP8_FORMATS)} (megatron-core's formats), "
                        "or null")
    recipe = overrides.get("fp8_recipe", DEFAULT_RECIPE)
    if recipe not in FP8_RECIPES and (recipe is not None or fmt is not None):  # the field is Optional; FP8 needs one
        problems.append(f"{prefix}.fp8_recipe={recipe}: must be one of {', '.join(FP8_RECIPES)} (megatron-core's "
                        "recipes)")
    if overrides.get("fp8_param"):
        problems.append(f"{prefix}.fp8_param={overrides['fp8_param']}: not built: {FP8_PARAM_REASON}; remove it")
    return problems


def fp8_device_problem(fmt: Optional[str], recipe: str, *, on_cuda: bool, transformer_engine_layers: bool,
                       capability: Optional[tuple[int, int]] = None, cuda_version: Optional[str] = None,
                       te_version: Optional[str] = None) -> Optional[str]:
    """Why FP8 format `fmt` with `recipe` cannot train here, or None (also for `fmt` None). On a CPU
    (`on_cuda` False) or without transformer-engine layers it would silently train in bf16 (see the
    module's docstring). On a GPU, transformer-engine's rules (quantization.py `_compute_fp8_support`,
    `_compute_fp8_block_scaling_support`, `_compute_mxfp8_support`): FP8 at compute capability >= 9.0,
    or 8.9 (Ada) with CUDA >= 12.1; blockwise at >= 9.0 with CUDA >= 12.9; mxfp8 at >= 10.0 and
    < 12.0. `capability` is torch.cuda.get_device_capability(), `cuda_version` torch.version.cuda,
    `te_version` the installed transformer-engine's (megatron-core's minimum for the recipe:
    TE_MIN_VERSION); None: not checked."""
    if fmt is None:
        return None
    if not on_cuda:
        return ("FP8 training needs a CUDA GPU: it runs transformer-engine's FP8 GEMMs, which have no CPU build "
                "(megatron-core's get_fp8_context is a no-op without transformer-engine, so the run would train in "
                "bf16); remove fp8 on a CPU")
    if not transformer_engine_layers:
        return ("FP8 training needs transformer-engine layers: megatron's local layers (built without "
                "transformer-engine installed, and for every LoRA role) have no FP8 GEMM, and megatron-core's "
                "get_fp8_context is a no-op without transformer-engine; install transformer-engine (no FP8 with LoRA)")
    if te_version is not None and recipe in TE_MIN_VERSION:
        from packaging.version import Version

        if Version(te_version) < Version(TE_MIN_VERSION[recipe]):
            return (f"fp8_recipe={recipe} needs transformer-engine >= {TE_MIN_VERSION[recipe]} (megatron-core "
                    f"fp8_utils.get_fp8_recipe), found {te_version}")
    if capability is None:
        return None
    cuda = tuple(int(p) for p in cuda_version.split(".")[:2]) if cuda_version else None
    where = f"this GPU (compute capability {capability[0]}.{capability[1]}, CUDA {cuda_version})"
    if capability < (8, 9) or (capability < (9, 0) and cuda is not None and cuda < (12, 1)):
        return (f"FP8 training on {where}: transformer-engine needs compute capability 8.9 or higher (Ada with CUDA "
                ">= 12.1, Hopper and later) for FP8 execution")
    if recipe == "blockwise" and (capability < (9, 0) or (cuda is not None and cuda < (12, 9))):
        return (f"fp8_recipe=blockwise on {where}: transformer-engine's FP8 block scaled GEMM requires compute "
                "capability 9.0 or higher and CUDA >= 12.9")
    if recipe == "mxfp8" and not (10, 0) <= capability < (12, 0):
        return (f"fp8_recipe=mxfp8 on {where}: transformer-engine runs MXFP8 at compute capability 10.0 (Blackwell) "
                "up to, not including, 12.0")
    return None
