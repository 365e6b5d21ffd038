"""`HiddenStatesGPTModel` returns the final hidden states instead of logits: through megatron-core's
public `forward(output_processor=...)` hook on 0.19, and by overriding the private
`GPTModel._postprocess` on 0.16, which has no public way. These tests fail loudly when megatron
changes what either way relies on: the hook on the versions that have it, the private method and
its `hidden_states` parameter on the others, and that the hidden states returned are the final
norm's output, which megatron's own output layer turns into its logits."""
import inspect

import pytest
import torch
from hidden_states_world import hidden_states_world
from packaging.version import Version

from megarl.engines.megatron.cpu.shims import megatron_core_version
from megarl.testing import run_gloo_workers
from megarl.engines.megatron.model import check_postprocess_hook, has_output_processor


def test_installed_gpt_model_has_the_hook_the_model_relies_on():
    from megatron.core.models.gpt.gpt_model import GPTModel

    if Version(megatron_core_version()) >= Version("0.19"):  # the public hook appeared in 0.19
        assert has_output_processor(GPTModel)
        assert "output_processor" in inspect.signature(GPTModel._postprocess).parameters
    else:
        assert not has_output_processor(GPTModel)
        assert list(inspect.signature(GPTModel._postprocess).parameters)[:2] == ["self", "hidden_states"]
        check_postprocess_hook(GPTModel)


def test_the_public_hook_is_detected_from_the_forward_signature():
    class WithHook:
        def forward(self, input_ids, *, output_processor=None):
            return input_ids

    class WithoutHook:
        def forward(self, input_ids, labels=None):
            return input_ids

    assert has_output_processor(WithHook) and not has_output_processor(WithoutHook)


def test_a_gpt_model_without_that_postprocess_is_refused_by_name():
    class Renamed:
        def _postprocess(self, decoder_output, **kwargs):
            return decoder_output

    for model_class in (object, Renamed):
        with pytest.raises(RuntimeError, match=r"megatron-core .*: GPTModel has .*_postprocess.*adapt megarl"):
            check_postprocess_hook(model_class)


@pytest.fixture(scope="module")
def passes(tiny_models):
    return run_gloo_workers(hidden_states_world, 1, args=(tiny_models,), timeout_s=300)[0]


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_the_chunk_returns_the_final_norm_output_that_megatron_turns_into_logits(name, passes):
    run = passes[name]
    hidden, logits = run["hidden"], run["logits"]
    assert hidden.dim() == 3 and hidden.shape[:2] == logits.shape[:2][::-1]  # [S, b, H] vs [b, S, V]
    assert torch.equal(hidden, run["final_norm"])
    # megatron's output layer (a column-parallel linear at TP1) on these hidden states
    torch.testing.assert_close((hidden @ run["output_weight"].t()).transpose(0, 1), logits, rtol=0, atol=1e-6)
