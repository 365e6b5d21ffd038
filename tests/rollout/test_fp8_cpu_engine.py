"""The FP8 checkpoint megarl writes for its rollout servers (`megarl.sync.fp8_checkpoint`) and the CPU
engine serving it (`rollout/cpu/fp8_weights.py`), in process. Oracles: HF transformers 5.25 loading the
checkpoint (FP8 on a CPU: `FineGrainedFP8HfQuantizer` dequantizes it) and its FP8 quantizer and
dequantizer (`integrations/finegrained_fp8.py`); SGLang's refusals, quoted from its 0.5.23 source."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from megarl.data.tiny_model import make_tiny_model
from megarl.rollout import fp8
from megarl.rollout.cpu.engine import CPUEngine
from megarl.rollout.protocol import BadRequestError
from megarl.sync.fp8_checkpoint import fp8_plan_of, write_fp8_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from fp8_oracles import same_bits, transformers_dequantize, transformers_quantize  # noqa: E402

# Every linear layer quantizable at TP 1 (2 heads of 64: q, k, v of 128 rows; MLP 256), whole blocks only
# (transformers dequantizes whole blocks only); the MoE: 4 experts of width 128.
MODELS = {"qwen2": dict(arch="qwen2", hidden=128, heads=2, kv_heads=2, intermediate=256),
          "qwen3_moe": dict(arch="qwen3_moe", hidden=128, heads=2, kv_heads=2, intermediate=128, tie=False)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{model: (HF directory, its FP8 checkpoint written by megarl)}."""
    root = tmp_path_factory.mktemp("fp8-ckpt")
    out = {}
    for name, kwargs in MODELS.items():
        src = make_tiny_model(out_dir=root / name, seed=3, **kwargs)
        out[name] = (src, write_fp8_checkpoint(src, root / f"{name}-fp8"))
    return out


@pytest.fixture(scope="module")
def engine(checkpoints):
    eng = CPUEngine(str(checkpoints["qwen2"][1]), dtype="bfloat16")
    yield eng
    eng.shutdown()


def checkpoint_tensors(path) -> dict:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("model", MODELS)
def test_megarls_fp8_checkpoint_loads_in_transformers_as_the_cpu_engine_serves_it(checkpoints, model):
    src, out = checkpoints[model]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    source, written = checkpoint_tensors(src), checkpoint_tensors(out)
    quantized = {n for n, t in written.items() if t.dtype == torch.float8_e4m3fn}
    linears = {n for n in source if n.endswith(("_proj.weight",)) and ".mlp.gate." not in n}
    assert quantized == linears and len(quantized) > 6  # attention, MLP / experts; not the router, embeddings
    for name in quantized:  # transformers' quantizer of the source weight, bit for bit
        values, scale_inv = transformers_quantize(source[name])
        assert same_bits(written[name], values) and torch.equal(written[fp8.scale_name(name)], scale_inv)
    for name in set(source) - quantized:
        assert torch.equal(written[name], source[name])
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)  # dequantized by transformers
    eng = CPUEngine(str(out), dtype="bfloat16")
    try:
        theirs, ours = hf.state_dict(), eng.model.state_dict()
        assert theirs.keys() == ours.keys()
        for name in theirs:
            assert same_bits(ours[name], theirs[name]), name
        assert eng.fp8 is not None and eng.fp8.quantized == quantized
    finally:
        eng.shutdown()


def test_the_checker_reports_fp8_values_and_scales_as_sglang_holds_them(engine, checkpoints):
    _, out = checkpoints["qwen2"]
    written = checkpoint_tensors(out)
    with engine.exclusive_model() as model:
        held = dict(engine.checked_tensors(model))
    name = "model.layers.0.mlp.down_proj.weight"
    scale = fp8.scale_name(name)
    assert same_bits(held[name], written[name]) and torch.equal(held[scale], written[scale])
    # the checkpoint's names: values, scales, the rest (the tied LM head once), and the rotary buffers, which
    # the checker leaves out (weights_checker.NON_PERSISTENT_BUFFER_PATTERNS)
    assert {n for n in held if "inv_freq" not in n} == set(written)


def test_a_push_replaces_values_and_scales_and_the_model_computes_with_their_dequantization(engine):
    name = "model.layers.1.self_attn.o_proj.weight"
    state = engine.model.state_dict()
    new = torch.randn(128, 128, generator=torch.Generator().manual_seed(5)) * 0.03
    values, scale_inv = transformers_quantize(new)
    before = {k: v.clone() for k, v in state.items()}
    assert engine.load_weights([(name, values), (fp8.scale_name(name), scale_inv),
                                ("model.norm.weight", torch.full((128,), 0.5))]) == 3
    assert same_bits(state[name], transformers_dequantize(values, scale_inv, torch.bfloat16))
    assert torch.equal(state["model.norm.weight"], torch.full((128,), 0.5, dtype=torch.bfloat16))
    assert all(torch.equal(state[k], before[k]) for k in state if k not in (name, "model.norm.weight"))
    with engine.exclusive_model() as model:
        held = dict(engine.checked_tensors(model))
    assert same_bits(held[name], values) and torch.equal(held[fp8.scale_name(name)], scale_inv)


@pytest.mark.parametrize("tensors, message", [
    (lambda q, s, n: [(n, q)], "comes without its scale"),
    (lambda q, s, n: [(fp8.scale_name(n), s)], "comes without its values"),
    (lambda q, s, n: [(n, q.to(torch.bfloat16)), (fp8.scale_name(n), s)], "holds it in block FP8"),
    (lambda q, s, n: [(n, q), (fp8.scale_name(n), s[:1])], r"has \(2, 1\) blocks"),
    (lambda q, s, n: [("model.norm.weight", q[0])], "does not quantize it"),
    (lambda q, s, n: [("model.norm.weight_scale_inv", s)], "which is not quantized here"),
], ids=["values-alone", "scale-alone", "bf16-values", "scale-shape", "fp8-for-a-norm", "scale-for-a-norm"])
def test_a_push_that_does_not_fit_the_fp8_weights_is_refused_whole(engine, tensors, message):
    name = "model.layers.0.mlp.gate_proj.weight"  # [256, 128]: 2 x 1 blocks
    values, scale_inv = transformers_quantize(torch.randn(256, 128) * 0.02)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(BadRequestError, match=message):
        engine.load_weights([("model.norm.weight", torch.zeros(128))] + tensors(values, scale_inv, name))
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())  # nothing loaded


def edited_copy(out, tmp_path, config_change=None, drop=None):
    """A copy of FP8 checkpoint `out` with its quantization_config changed, or a tensor dropped."""
    copy = tmp_path / "edited"
    shutil.copytree(out, copy)
    if config_change:
        config = json.loads((copy / "config.json").read_text())
        config["quantization_config"].update(config_change)
        (copy / "config.json").write_text(json.dumps(config))
    if drop:
        tensors = checkpoint_tensors(copy)
        for f in copy.glob("*.safetensors"):
            f.unlink()
        (copy / "model.safetensors.index.json").unlink()
        save_file({k: v for k, v in tensors.items() if k != drop}, copy / "model.safetensors",
                  metadata={"format": "pt"})
    return copy


def test_the_engine_refuses_what_sglang_refuses(checkpoints, tmp_path):
    """SGLang 0.5.23: FP8 computes in bfloat16 or float16 (`model_loader/loader.py::_get_quantization_config`);
    a fused layer is quantized whole (`is_layer_skipped`); qkv_proj's parts are whole blocks
    (`validate_block_quant_shapes`); `Fp8Config` takes a dynamic or static activation scheme."""
    _, out = checkpoints["qwen2"]
    with pytest.raises(ValueError, match=r"torch.float32 is not supported for quantization method fp8"):
        CPUEngine(str(out), dtype="float32")
    partial = edited_copy(out, tmp_path / "a", {"ignored_layers": ["model.layers.0.self_attn.k_proj"]})
    with pytest.raises(ValueError, match="Detected some but not all shards of model.layers.0.self_attn.qkv_proj"):
        CPUEngine(str(partial), dtype="bfloat16")
    with pytest.raises(ValueError, match="Unsupported activation scheme per_tensor"):
        CPUEngine(str(edited_copy(out, tmp_path / "b", {"activation_scheme": "per_tensor"})), dtype="bfloat16")
    tiny = make_tiny_model("qwen2", tmp_path / "kv64", hidden=128, heads=4, kv_heads=2)  # k, v: 64 rows
    everything = fp8.plan({n: s for n, s in ((n, t.shape) for n, t in checkpoint_tensors(tiny).items())}, 1, kv_heads=2)
    assert everything.ignored_layers  # megarl's own plan keeps q, k, v unquantized ...
    forced = write_fp8_checkpoint(tiny, tmp_path / "kv64-fp8",
                                  fp8.Fp8Plan(everything.quantized | {f"model.layers.0.self_attn.{p}_proj.weight"
                                                                      for p in "qkv"}))
    with pytest.raises(ValueError, match="64 rows per TP rank of the fused qkv_proj"):  # ... SGLang refuses them
        CPUEngine(str(forced), dtype="bfloat16")


def test_the_engine_refuses_a_quantized_weight_without_its_scale(checkpoints, tmp_path):
    """Stricter than SGLang, which would serve the weight with the scale parameter's initial value."""
    _, out = checkpoints["qwen2"]
    with pytest.raises(ValueError, match="down_proj.weight comes without its scale"):
        CPUEngine(str(edited_copy(out, tmp_path, drop="model.layers.1.mlp.down_proj.weight_scale_inv")),
                  dtype="bfloat16")


def test_a_disk_update_keeps_the_served_quantization(engine, checkpoints):
    src, out = checkpoints["qwen2"]
    with pytest.raises(BadRequestError, match="is not quantized as the served model is"):
        engine.load_weights_from_disk(str(src))
    engine.load_weights_from_disk(str(out))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).state_dict()
    assert all(same_bits(t, hf[k]) for k, t in engine.model.state_dict().items())


def test_plan_of_a_checkpoint_reads_its_key_value_heads(checkpoints):
    src, _ = checkpoints["qwen2"]
    assert fp8_plan_of(src, tp_size=2).ignored_layers == (  # 2 kv heads over 2 ranks: k, v 64 rows each
        "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.o_proj",
        "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj")
