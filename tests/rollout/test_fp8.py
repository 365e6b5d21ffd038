"""megarl.rollout.fp8, the block-FP8 format, against transformers 5.25's own quantizer and dequantizer
(`integrations/finegrained_fp8.py::Fp8Quantize`, `Fp8Dequantize`), and its plan of which layers stay
unquantized against SGLang 0.5.23's rules computed by hand. The ragged blocks and SGLang's own code:
tests/sglang/test_fp8_oracle.py."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megarl.rollout import fp8

sys.path.insert(0, str(Path(__file__).parent))
from fp8_oracles import same_bits, transformers_dequantize, transformers_quantize, weight  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 384), (128, 128), (512, 256)])
def test_quantize_and_dequantize_equal_transformers(shape, dtype):
    w = weight(shape, dtype)
    values, scale_inv = fp8.quantize(w)
    ref_values, ref_scale_inv = transformers_quantize(w)
    assert same_bits(values, ref_values)
    assert scale_inv.dtype == torch.float32 and torch.equal(scale_inv, ref_scale_inv)
    assert scale_inv[0, 0] == 1.0 and not values[:128, :128].float().any()  # the zero block
    for out in (torch.bfloat16, torch.float32):
        assert same_bits(fp8.dequantize(values, scale_inv, out), transformers_dequantize(values, scale_inv, out))
    # the round trip is the quantization's error only: within half an e4m3 step (2^-4 relative) of each value
    error = (fp8.dequantize(values, scale_inv, torch.float32) - w.float()).abs()
    assert (error <= w.float().abs() * 2**-4 + scale_inv.max() * 2**-9).all()


@pytest.mark.parametrize("shape", [(200, 300), (130, 257), (1, 129), (576, 384), (129, 1)])
def test_a_ragged_last_block_is_quantized_as_if_padded_with_zeros(shape):
    """transformers quantizes whole blocks only: its quantizer on the zero-padded weight, cropped, is the
    reference (the padding leaves every block's amax alone)."""
    w = weight(shape, torch.bfloat16, seed=1)
    rows, cols = shape
    padded = F.pad(w, (0, -cols % 128, 0, -rows % 128))
    ref_values, ref_scale_inv = transformers_quantize(padded)
    values, scale_inv = fp8.quantize(w)
    assert same_bits(values, ref_values[:rows, :cols].contiguous())
    assert torch.equal(scale_inv, ref_scale_inv) and scale_inv.shape == fp8.scale_shape(shape)


def test_dequantize_refuses_a_scale_of_the_wrong_shape():
    values, scale_inv = fp8.quantize(weight((256, 256)))
    with pytest.raises(ValueError, match=r"need \(2, 2\)"):
        fp8.dequantize(values, scale_inv[:1], torch.bfloat16)


# ------------------------------------------------------------------------------------------ the plan
def qwen2_shapes(hidden, heads, kv_heads, head_dim, intermediate, layers=1, vocab=151936):
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.q_proj.bias": (heads * head_dim,),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (intermediate, hidden), f"{p}.mlp.up_proj.weight": (intermediate, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, intermediate), f"{p}.input_layernorm.weight": (hidden,),
        })
    return shapes


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_plan_quantizes_every_linear_and_nothing_else():
    """Qwen2.5-0.5B's shapes (hidden 896 = 7 blocks, 14 heads and 2 key/value heads of 64, MLP 4864 = 38
    blocks) at rollout TP 1: every linear layer passes SGLang's checks; embeddings, LM head, norms and
    biases are never quantized."""
    shapes = qwen2_shapes(896, 14, 2, 64, 4864)
    plan = fp8.plan(shapes, tp_size=1, kv_heads=2)
    assert plan.quantized == {n for n in shapes if n.endswith(tuple(f"{p}.weight" for p in LINEARS))}
    assert plan.ignored_layers == () and plan.problems == ()


def test_plan_keeps_layers_sglang_would_refuse_unquantized_with_their_fused_shards():
    """The same model at rollout TP 2 (SGLang 0.5.23 `Fp8LinearMethod.validate_block_quant_shapes`): q has
    448 rows per rank and k/v 64 (2 key/value heads over 2 ranks: one of 64 rows each), so the fused
    qkv_proj stays unquantized, all three shards; o_proj's 448 input columns per rank too; gate/up's
    2432 rows and down's 2432 columns per rank are 19 blocks: quantized."""
    shapes = qwen2_shapes(896, 14, 2, 64, 4864)
    plan = fp8.plan(shapes, tp_size=2, kv_heads=2)
    p = "model.layers.0"
    assert plan.ignored_layers == tuple(f"{p}.self_attn.{n}" for n in ("k_proj", "o_proj", "q_proj", "v_proj"))
    assert plan.quantized == {f"{p}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    assert sorted(plan.problems) == sorted([
        f"{p}.self_attn.q_proj.weight: 448 rows per TP rank of the fused qkv_proj, not a multiple of 128",
        f"{p}.self_attn.k_proj.weight: 64 rows per TP rank of the fused qkv_proj, not a multiple of 128",
        f"{p}.self_attn.v_proj.weight: 64 rows per TP rank of the fused qkv_proj, not a multiple of 128",
        f"{p}.self_attn.o_proj.weight: 448 input columns per TP rank, not a multiple of 128",
    ])
    # the tiny test model (hidden 128, 4 heads and 2 key/value heads of 32) at TP 1: k and v have 64 rows
    tiny = fp8.plan(qwen2_shapes(128, 4, 2, 32, 256), tp_size=1, kv_heads=2)
    assert tiny.ignored_layers == tuple(f"{p}.self_attn.{n}" for n in ("k_proj", "q_proj", "v_proj"))
    assert tiny.quantized == {f"{p}.self_attn.o_proj.weight", *(f"{p}.mlp.{n}.weight" for n in ("gate_proj", "up_proj",
                                                                                                  "down_proj"))}


def test_plan_of_experts_routers_and_shared_experts():
    """Qwen2-MoE names: the routed experts are one FusedMoE per layer (quantized when the expert width per
    rank is a multiple of 128, SGLang's `Fp8MoEMethod.create_weights`), the router (`mlp.gate`) and the
    shared-expert gate never; the shared expert is an MLP like any other."""
    p = "model.layers.0.mlp"
    shapes = {f"{p}.gate.weight": (4, 128), f"{p}.shared_expert_gate.weight": (1, 128),
              f"{p}.shared_expert.gate_proj.weight": (256, 128), f"{p}.shared_expert.up_proj.weight": (256, 128),
              f"{p}.shared_expert.down_proj.weight": (128, 256)}
    for e in range(4):
        shapes.update({f"{p}.experts.{e}.gate_proj.weight": (128, 128), f"{p}.experts.{e}.up_proj.weight": (128, 128),
                       f"{p}.experts.{e}.down_proj.weight": (128, 128)})
    expert_names = {n for n in shapes if ".experts." in n}
    shared = {n for n in shapes if ".shared_expert." in n}
    assert fp8.plan(shapes, tp_size=1).quantized == expert_names | shared
    assert fp8.plan(shapes, tp_size=2, ep_size=2).quantized == expert_names | shared  # EP 2: the experts whole
    narrow = fp8.plan(shapes, tp_size=2, ep_size=1)  # expert TP 2: 64 rows of gate/up per rank
    assert narrow.ignored_layers == (f"{p}.experts",) and narrow.quantized == shared


@pytest.mark.parametrize("ignored, quantized", [
    ([], {"q", "k", "v", "o"}),
    (["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"], {"o"}),
    (["layers.0.self_attn.o_proj"], {"q", "k", "v"}),  # SGLang adds the `model.` prefix
    (["self_attn.o"], {"q", "k", "v", "o"}),  # module boundaries: `o` is not `o_proj`
])
def test_quantized_weights_read_ignored_layers_as_sglang(ignored, quantized):
    names = [f"model.layers.0.self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
    got = fp8.quantized_weights(names, ignored)
    assert got == {f"model.layers.0.self_attn.{n}_proj.weight" for n in quantized}


def test_a_fused_layer_quantized_in_part_is_refused():
    names = [f"model.layers.0.self_attn.{n}_proj.weight" for n in ("q", "k", "v")]
    with pytest.raises(ValueError, match="Detected some but not all shards of model.layers.0.self_attn.qkv_proj"):
        fp8.quantized_weights(names, ["model.layers.0.self_attn.k_proj"])


def test_quantization_config_is_verls_and_parses_back():
    assert fp8.quantization_config() == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}  # verl's build_sglang_fp8_quant_config
    config = fp8.quantization_config(["model.layers.0.self_attn.q_proj"])
    assert config["ignored_layers"] == config["modules_to_not_convert"] == ["model.layers.0.self_attn.q_proj"]
    assert fp8.parse_quantization_config(config) == fp8.Fp8Serving(("model.layers.0.self_attn.q_proj",))
    assert fp8.parse_quantization_config(None) is None


@pytest.mark.parametrize("change, message", [
    ({"activation_scheme": "tensor"}, "Unsupported activation scheme tensor"),  # SGLang's words
    ({"weight_block_size": [128]}, "must have 2 dimensions, but got 1 dimensions"),
    ({"activation_scheme": "static"}, "only supports dynamic activation scheme"),
    ({"weight_block_size": [64, 64]}, "128 x 128 blocks"),
    ({"quant_method": "awq"}, "serves fp8 only"),
])
def test_parse_refuses_what_sglang_or_megarl_does_not_serve(change, message):
    with pytest.raises(ValueError, match=message):
        fp8.parse_quantization_config({**fp8.quantization_config(), **change})
