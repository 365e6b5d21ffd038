"""Does real SGLang 0.5.23 serve a block-FP8 checkpoint on this CPU? No: it loads megarl's FP8 checkpoint
through its own loader (every value and `weight_scale_inv` into its FP8 parameters), then stops in the
FP8 layers' post-processing, which needs AMX (`layers/quantization/fp8.py::Fp8LinearMethod.
process_weights_after_loading_block_quant`), and the server exits: the premise of the config rule
`fp8_rollout_fits`; on a CPU the CPU engine serves FP8 (tests/rollout/test_fp8_cpu_engine.py). (Its
other refusal the rule quotes, a float32 compute dtype, comes before the model loads, from
`model_loader/loader.py::_get_quantization_config`; one more server start would show it.)"""
import pytest

from megarl.rollout.process import ServerStartError
from megarl.sync.fp8_checkpoint import write_fp8_checkpoint
from real_sglang import make_model, start_sglang


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """megarl's FP8 checkpoint of a tiny Qwen2 whose every linear layer is quantized (2 heads of 64)."""
    root = tmp_path_factory.mktemp("sglang-fp8")
    return write_fp8_checkpoint(make_model("qwen2", root / "bf", hidden=128, heads=2, kv_heads=2), root / "fp8")


def test_sglang_loads_megarls_fp8_checkpoint_and_stops_for_want_of_amx(fp8_dir, tmp_path):
    with pytest.raises(ServerStartError) as info:
        start_sglang(str(fp8_dir), tmp_path, name="sglang-fp8", dtype="bfloat16", startup_timeout_s=240)
    log = str(info.value)
    assert "in load_weights_and_postprocess" in log and "in process_weights_after_loading_block_quant" in log
    assert "AssertionError: Fp8LinearMethod on CPU requires that CPU has AMX support" in log

