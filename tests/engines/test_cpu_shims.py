"""megarl.engines.megatron.cpu.shims: every CPU shim is needed, and together they run megatron-core.

The scenario (2 gloo processes) exercises every shim once: PP=2 with tied embeddings, megatron
DDP, a 1F1B forward/backward through `get_forward_backward_func` and an optimizer step with
gradient clipping. With all shims it succeeds; without any one of them it fails at the
megatron-core line that shim documents. `python test_cpu_shims.py` runs all variants; the
shims are never applied in the pytest process itself (they patch torch globally).
"""
import json
import re
import subprocess
import sys

import pytest
import torch

from megarl import testing
from megarl.engines.megatron.cpu import shims as cpu_shims
from megarl.engines.megatron.cpu.shims import CPU_SHIMS, UnverifiedMegatronVersion, megatron_core_version, shims_for

SHIMS = shims_for(megatron_core_version(), cuda=False)  # the installed megatron-core's

# what the traceback shows when the shim is missing: the megatron source line that needs it
FAILS_WITHOUT = {
    "current_device": r"megatron/core/.*\n.*torch\.cuda\.current_device\(\)",
    "synchronize": r"p2p_communication\.py.*\n\s*torch\.cuda\.synchronize\(\)",
    "rng_tracker": r"tensor_parallel/random\.py.*\n.*torch\.cuda\.get_rng_state\(\)",
    "cuda_factories": r"megatron/core/.*\n.*device=.cuda.[,)]",
    "tensor_type_names": r"clip_grads\.py.*\n\s*assert param\.grad\.type\(\) == 'torch\.cuda\.FloatTensor'",
    "tensor_cuda": r"language_module\.py.*\n\s*weight\.data = weight\.data\.cuda\(\)",
    "current_stream": r"param_and_grad_buffer\.py.*\n\s*current_stream = torch\.cuda\.current_stream\(\)",
    "sequence_parallel_norm": r"torch_norm\.py.*\n\s*assert not config\.sequence_parallel",
}


def scenario(rank: int, world_size: int, port: int, shims: list) -> float:
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    testing.init_gloo_model_parallel(rank, world_size, port, tp=1, pp=2, cpu_shims=shims)
    patched = torch.cuda.current_device
    assert cpu_shims.apply_cpu_shims(shims) == tuple(s for s in CPU_SHIMS if s in shims)  # idempotent
    assert torch.cuda.current_device is patched
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    gpt = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64, max_sequence_length=16,
                   position_embedding_type="rope", share_embeddings_and_output_weights=True,
                   pre_process=first, post_process=last)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt)
    config.no_sync_func, config.finalize_model_grads_func = model.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)

    def step(data_iterator, chunk):
        losses = chunk(input_ids=ids, position_ids=positions, attention_mask=None, labels=ids)
        return losses, lambda out: (out.mean(), {"loss": out.mean().detach().clone()})

    model.zero_grad_buffer()
    optimizer.zero_grad()
    store = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None] * 2), model=[model],
                                        num_microbatches=2, seq_length=16, micro_batch_size=2, forward_only=False)
    updated, grad_norm, _ = optimizer.step()
    assert updated and grad_norm > 0
    # the local spec's RMSNorm of a sequence-parallel model (TP2: a config only, no TP2 world needed)
    sp_config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization="RMSNorm",
                                  tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)
    norm_class = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.input_layernorm
    norm = norm_class(config=sp_config, hidden_size=32, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel  # its grads summed over TP
    return store[0]["loss"].item() if last else None


@pytest.fixture(scope="module")
def outcomes():
    """{"all" or the shim left out: {"loss": ...} or {"error": the failing rank's traceback}}."""
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_all_shims_run_pipeline_training_with_tied_embeddings(outcomes):
    assert "loss" in outcomes["all"], outcomes["all"].get("error")
    assert 0 < outcomes["all"]["loss"] < 2 * torch.log(torch.tensor(64.0)).item()  # a fresh model: near log(vocab)


def test_the_shims_a_release_needs_on_a_cpu():
    assert shims_for("0.16.1", cuda=False) == ("current_device", "synchronize", "rng_tracker", "cuda_factories",
                                               "tensor_type_names", "tensor_cuda", "sequence_parallel_norm")
    assert shims_for("0.19.2", cuda=False) == shims_for("0.16.1", cuda=False) + ("current_stream",)


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_no_shim_is_chosen_with_cuda(version):
    assert shims_for(version, cuda=True) == ()


@pytest.mark.parametrize("shim", SHIMS)
def test_each_shim_is_needed(shim, outcomes):
    assert "error" in outcomes[shim], f"the scenario passed without {shim}"
    assert re.search(FAILS_WITHOUT[shim], outcomes[shim]["error"]), outcomes[shim]["error"][-4000:]


def test_unverified_megatron_version_is_refused_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cpu_shims, "megatron_core_version", lambda: "0.17.0")
    with pytest.raises(UnverifiedMegatronVersion, match=r"megatron-core 0\.17\.0 .* verified on 0\.16\.1, 0\.19\.2"):
        cpu_shims.apply_cpu_shims()
    with pytest.raises(ValueError, match="unknown CPU shim"):
        cpu_shims.apply_cpu_shims(["rng"])
    assert cpu_shims._applied == set()  # refused before patching anything


def test_shims_are_not_applied_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_shims, "megatron_core_version", lambda: "0.99.0")  # unverified, but nothing to patch
    assert cpu_shims.apply_cpu_shims() == ()
    assert cpu_shims._applied == set()


def run_all_scenarios() -> dict:
    """The scenario with all shims, then without each one; each in 2 processes forked by
    `run_gloo_workers`' forkserver, which imported megatron but never applies a shim (so each world
    starts unpatched)."""
    outcomes = {}
    for left_out in [None, *SHIMS]:
        shims = [s for s in SHIMS if s != left_out]
        try:
            losses = testing.run_gloo_workers(scenario, 2, args=(shims,), timeout_s=120)
            outcomes[left_out or "all"] = {"loss": losses[1]}
        except Exception as e:  # a rank's failure, with its traceback
            outcomes[left_out or "all"] = {"error": str(e)}
    return outcomes


if __name__ == "__main__":
    print(json.dumps(run_all_scenarios()))
