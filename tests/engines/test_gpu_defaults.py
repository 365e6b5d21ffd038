"""GPU training defaults, decided by pure functions and checked on CPU per case: DDP overlap
(`optim.ddp_overlap`) and megatron's fusions (`model.fusion_flags`). Every field they set must exist
in the installed megatron-core (run this file with both .venv and .venv312: 0.16.1 and 0.19.2).
The engine on CPU builds with the CPU decision: tests/engines/test_megatron_engine.py."""
import dataclasses
import inspect
import itertools

import pytest
import torch

from megarl.bridge import arch_from_hf_config
from megarl.bridge.megatron_config import transformer_config_kwargs
from megarl.engines.megatron.model import fusion_flags
from megarl.engines.megatron.optim import ddp_overlap

OFF = {"overlap_grad_reduce": False, "overlap_param_gather": False, "align_param_gather": False}
ON = {"overlap_grad_reduce": True, "overlap_param_gather": True, "align_param_gather": False}

NO_FUSION = {"bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
             "gradient_accumulation_fusion": False, "masked_softmax_fusion": False, "persist_layer_norm": False,
             "cross_entropy_loss_fusion": False}


# ------------------------------------------------------------------------------------------ DDP overlap
# The decision does not depend on the device: megatron's gloo path runs the overlap too (see ddp_overlap).
@pytest.mark.parametrize("case, kwargs, expected", [
    ("trained, DP2, distributed optimizer", dict(trains=True, dp_size=2, distributed_optimizer=True), ON),
    ("trained, DP8, distributed optimizer", dict(trains=True, dp_size=8, distributed_optimizer=True), ON),
    ("trained, DP1, distributed optimizer", dict(trains=True, dp_size=1, distributed_optimizer=True), OFF),
    ("trained, DP2, plain optimizer", dict(trains=True, dp_size=2, distributed_optimizer=False), OFF),
    ("forward-only role, DP2", dict(trains=False, dp_size=2, distributed_optimizer=True), OFF),
])
def test_ddp_overlap_per_case(case, kwargs, expected):
    assert ddp_overlap(**kwargs) == expected, case


# ------------------------------------------------------------------------------------------ fusions
CUDA_FORWARD = {**NO_FUSION, "bias_activation_fusion": True, "bias_dropout_fusion": True}
CUDA_TE_FORWARD = {**CUDA_FORWARD, "apply_rope_fusion": True}


@pytest.mark.parametrize("case, kwargs, expected", [
    ("CPU", dict(on_cuda=False, transformer_engine=False, lora=False, trains=True, apex_grad_accumulation=False),
     NO_FUSION),
    ("CPU, whatever is claimed installed",
     dict(on_cuda=False, transformer_engine=True, lora=False, trains=True, apex_grad_accumulation=True), NO_FUSION),
    ("CUDA without TE (pip torch), trained",
     dict(on_cuda=True, transformer_engine=False, lora=False, trains=True, apex_grad_accumulation=False), CUDA_FORWARD),
    ("CUDA without TE, with apex, trained",
     dict(on_cuda=True, transformer_engine=False, lora=False, trains=True, apex_grad_accumulation=True), CUDA_FORWARD),
    ("CUDA + TE + apex (NGC container), trained",
     dict(on_cuda=True, transformer_engine=True, lora=False, trains=True, apex_grad_accumulation=True),
     {**CUDA_TE_FORWARD, "gradient_accumulation_fusion": True}),
    ("CUDA + TE without apex, trained",
     dict(on_cuda=True, transformer_engine=True, lora=False, trains=True, apex_grad_accumulation=False),
     CUDA_TE_FORWARD),
    ("CUDA + TE + apex, forward-only role (reference, reward model)",
     dict(on_cuda=True, transformer_engine=True, lora=False, trains=False, apex_grad_accumulation=True),
     CUDA_TE_FORWARD),
    ("CUDA + TE + apex, LoRA (local layers), trained",
     dict(on_cuda=True, transformer_engine=True, lora=True, trains=True, apex_grad_accumulation=True),
     CUDA_TE_FORWARD),
])
def test_fusion_flags_per_case(case, kwargs, expected):
    assert fusion_flags(**kwargs) == expected, case


def test_actor_and_reference_get_the_same_forward_fusions():
    """Step-0 exactness: a trained role and a forward-only one differ only in a backward-only flag."""
    for on_cuda, te, lora, apex in itertools.product([False, True], repeat=4):
        inputs = dict(on_cuda=on_cuda, transformer_engine=te, lora=lora, apex_grad_accumulation=apex)
        trained, frozen = fusion_flags(**inputs, trains=True), fusion_flags(**inputs, trains=False)
        trained.pop("gradient_accumulation_fusion"), frozen.pop("gradient_accumulation_fusion")
        assert trained == frozen


# ------------------------------------------------------------------------------------------ megatron fields
def _all_fusion_decisions():
    for values in itertools.product([False, True], repeat=5):
        yield fusion_flags(**dict(zip(("on_cuda", "transformer_engine", "lora", "trains", "apex_grad_accumulation"),
                                      values)))


def _all_overlap_decisions():
    for trains, dp, dist_opt in itertools.product([False, True], [1, 2], [False, True]):
        yield ddp_overlap(trains=trains, dp_size=dp, distributed_optimizer=dist_opt)


def test_every_field_set_exists_in_the_installed_megatron_core():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    transformer = {f.name for f in dataclasses.fields(TransformerConfig)}
    ddp = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    optimizer = {f.name for f in dataclasses.fields(OptimizerConfig)}
    for flags in _all_fusion_decisions():
        assert set(flags) <= transformer, set(flags) - transformer
    for overlap in _all_overlap_decisions():
        assert set(overlap) <= ddp, set(overlap) - ddp
    assert {"grad_reduce_in_fp32", "use_distributed_optimizer"} <= ddp
    assert {"overlap_param_gather", "use_distributed_optimizer"} <= optimizer
    # what optim.finish_param_gather / gather_params_now call on megatron's DDP
    assert "force_sync" in inspect.signature(DistributedDataParallel.start_param_sync).parameters
    assert callable(_ParamAndGradBucketGroup.finish_param_sync)
    assert "self.param_to_bucket_group" in inspect.getsource(DistributedDataParallel.__init__)


def test_megatron_accepts_the_cuda_forward_fusions_for_megarls_models():
    """TransformerConfig's own checks (bias_activation_fusion: silu with a gated linear unit) pass
    for megarl's SwiGLU models. (apply_rope_fusion needs transformer-engine: a GPU check.)"""
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = arch_from_hf_config({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 100, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                "max_position_embeddings": 128, "tie_word_embeddings": True})
    kwargs = transformer_config_kwargs(arch, params_dtype=torch.bfloat16)
    config = TransformerConfig(**kwargs, **CUDA_FORWARD)
    assert config.bias_activation_fusion and config.bias_dropout_fusion and not config.apply_rope_fusion
