"""Rules on the rollout servers' quantization (`actor_rollout_ref.rollout.quantization`)."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig


def fp8_rollout_fits(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Block-FP8 rollout (megarl.rollout.fp8) as SGLang 0.5.23 serves it: its FP8 method computes in
    bfloat16 or float16 only and refuses any other `--dtype` at start (`model_loader/loader.py::
    _get_quantization_config`: "torch.float32 is not supported for quantization method fp8"; megarl's
    CPU engine refuses it too). On a CPU, SGLang's FP8 linear layers need AMX kernels
    (`layers/quantization/fp8.py::Fp8LinearMethod.process_weights_after_loading_block_quant` asserts
    "Fp8LinearMethod on CPU requires that CPU has AMX support", the server exits; its CPU FP8 GEMM is
    an `sgl_kernel` op that PyPI lacks besides): the CPU engine serves FP8 there.

    Reads: actor_rollout_ref.rollout.quantization, actor_rollout_ref.rollout.dtype,
    actor_rollout_ref.rollout.name, trainer.device
    """
    r = config.actor_rollout_ref.rollout
    if r.quantization != "fp8":
        return
    if r.dtype not in ("bfloat16", "float16"):
        yield (f"actor_rollout_ref.rollout.quantization=fp8 needs actor_rollout_ref.rollout.dtype bfloat16 or "
               f"float16 (got {r.dtype}): SGLang's FP8 layers compute in those only and refuse {r.dtype} at start")
    if r.name == "sglang" and config.trainer.device == "cpu":
        yield ("actor_rollout_ref.rollout.quantization=fp8 with rollout.name=sglang and trainer.device=cpu: SGLang "
               "0.5.23's FP8 layers on a CPU need AMX and sgl_kernel's CPU FP8 kernels, and the server exits at start "
               "(\"Fp8LinearMethod on CPU requires that CPU has AMX support\"); use actor_rollout_ref.rollout.name=cpu")


def fp8_rollout_corrected(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A warning (megarl.config.rules.WARNING_RULES): FP8 servers sample from a policy further from
    the trainer's than bf16 ones (their log-probs differ more), which a rollout correction is for
    (configs/recipes/grpo_fp8.yaml turns on token-level truncated IS).

    Reads: actor_rollout_ref.rollout.quantization, algorithm.rollout_correction,
    actor_rollout_ref.actor.tis_imp_ratio_cap
    """
    if config.actor_rollout_ref.rollout.quantization != "fp8":
        return
    if not (config.algorithm.rollout_correction.enabled or config.actor_rollout_ref.actor.tis_imp_ratio_cap > 0):
        yield ("actor_rollout_ref.rollout.quantization=fp8 without a correction of the rollout/trainer mismatch: "
               "set algorithm.rollout_correction (e.g. rollout_is=token with rollout_is_threshold=2.0, as "
               "configs/recipes/grpo_fp8.yaml) and watch rollout_corr/kl and training/rollout_probs_diff_*")
