"""megarl's block FP8 (megarl.rollout.fp8) against SGLang 0.5.23's own code from the wheel, run on the
CPU under its interpreter (`fp8_oracle.py`, one run for the module): its dequantizer on every block,
ragged last blocks and all-zero blocks included; its block quantizer; its reading of `ignored_layers`."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megarl.rollout import fp8
from real_sglang import sglang_client_env, sglang_python

sys.path.insert(0, str(Path(__file__).parents[1] / "rollout"))
from fp8_oracles import same_bits, transformers_quantize, weight  # noqa: E402

ORACLE = Path(__file__).parent / "fp8_oracle.py"
FP8_MAX = 448.0
SHAPES = [(200, 300), (130, 257), (1, 129), (576, 384), (129, 1), (256, 256)]  # all but the last: ragged
ATTN = "model.layers.0.self_attn"
SKIPPED = [  # (SGLang's layer prefix, ignored_layers)
    (f"{ATTN}.qkv_proj", [f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj"]),
    (f"{ATTN}.qkv_proj", [f"{ATTN}.q_proj"]),
    (f"{ATTN}.qkv_proj", []),
    ("model.layers.0.mlp.gate_up_proj", ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"]),
    ("model.layers.1.mlp.gate_up_proj", ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"]),
    ("model.layers.0.mlp.gate_up_proj", ["mlp.gate"]),
    (f"{ATTN}.o_proj", [f"{ATTN}.o_proj"]),
    ("model.layers.10.self_attn.o_proj", ["model.layers.1.self_attn.o_proj"]),
    ("model.layers.0.mlp.experts", ["model.layers.0.mlp.experts"]),
    ("model.layers.1.mlp.experts", ["model.layers.0.mlp.experts"]),
]


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' quantizer on the zero-padded weight, its values cropped (it quantizes whole blocks only)."""
    rows, cols = w.shape
    values, scale_inv = transformers_quantize(F.pad(w, (0, -cols % 128, 0, -rows % 128)))
    return values[:rows, :cols].contiguous(), scale_inv


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    """(weights, megarl's (values, scales), the reference's, SGLang's answers)."""
    root = tmp_path_factory.mktemp("fp8-oracle")
    weights = [weight(shape, torch.bfloat16, seed=k) for k, shape in enumerate(SHAPES)]
    ours = [fp8.quantize(w) for w in weights]
    reference = [reference_quantize(w) for w in weights]
    torch.save({"dequantize": ours + reference, "quantize": weights, "skipped": SKIPPED}, root / "cases.pt")
    subprocess.run([sglang_python(), str(ORACLE), str(root / "cases.pt"), str(root / "answers.pt")],
                   env=sglang_client_env(), check=True, timeout=300, stdout=subprocess.DEVNULL)
    return weights, ours, reference, torch.load(root / "answers.pt")


def test_dequantize_equals_sglangs_block_quant_dequant_on_every_block(sglang):
    """Ragged last blocks and an all-zero block (scale 1) included, into float32 and bfloat16."""
    _, ours, _, answers = sglang
    for (values, scale_inv), (f32, bf16) in zip(ours, answers["dequantize"]):
        assert torch.equal(fp8.dequantize(values, scale_inv, torch.float32), f32)
        assert same_bits(fp8.dequantize(values, scale_inv, torch.bfloat16), bf16)


def test_the_round_trip_equals_the_reference_quantizer_then_sglangs_dequantizer(sglang):
    """quantize -> dequantize of every block, bit for bit: transformers' quantizer (whole blocks,
    `reference_quantize`) followed by SGLang's `block_quant_dequant`."""
    weights, _, _, answers = sglang
    for w, (f32, bf16) in zip(weights, answers["dequantize"][len(weights):]):
        values, scale_inv = fp8.quantize(w)
        assert torch.equal(fp8.dequantize(values, scale_inv, torch.float32), f32)
        assert same_bits(fp8.dequantize(values, scale_inv, torch.bfloat16), bf16)


def test_values_equal_sglangs_block_quantizer(sglang):
    """SGLang's `per_block_cast_to_fp8` (DeepSeek-V3's benchmark quantizer; it pads ragged blocks with
    zeros itself) rounds W * (448 / amax) as megarl does: the same e4m3 values in every block whose
    amax reaches its floor of 1e-4. Its scale is amax / 448, megarl's (transformers') 1 / (448 / amax):
    equal to within one float32 step. Below the floor (an all-zero block, the tiny block of `weight`)
    SGLang scales as if amax were 1e-4, where megarl follows transformers (the block's own amax; 1 for
    an all-zero block)."""
    weights, ours, _, answers = sglang
    floored = 0
    for w, (values, scale_inv), (sgl_values, sgl_scale) in zip(weights, ours, answers["quantize"]):
        above = (FP8_MAX * scale_inv >= 1e-4) & (scale_inv != 1.0)  # amax = 448 * scale_inv, 1: a zero block
        per_element = above.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
        assert torch.equal(values.view(torch.uint8)[per_element], sgl_values.view(torch.uint8)[per_element])
        assert torch.allclose(scale_inv[above], sgl_scale[above], rtol=2**-23, atol=0)
        assert torch.all(sgl_scale[~above] == torch.tensor(1e-4) / FP8_MAX)
        floored += int((~above).sum())
    assert floored >= len(weights) - 1 and above.sum() > 1  # both kinds of block were met


def test_ignored_layers_are_read_as_sglang_reads_them(sglang):
    """`fp8.quantized_weights` against SGLang's `is_layer_skipped` under `Fp8Config.from_config`: the
    `model.` prefix, module boundaries, fused layers quantized whole or refused, per-layer experts."""
    answers = sglang[3]["skipped"]
    for (prefix, ignored), answer in zip(SKIPPED, answers):
        parent, _, leaf = prefix.rpartition(".")
        shards = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(leaf)
        names = ([f"{parent}.{s}.weight" for s in shards] if shards else
                 [f"{prefix}.0.gate_proj.weight"] if leaf == "experts" else [f"{prefix}.weight"])
        try:
            ours = not fp8.quantized_weights(names, ignored)
        except ValueError as e:
            ours = str(e)
        assert ours == answer, (prefix, ignored)
    assert isinstance(answers[1], str) and answers.count(True) == 4  # a refusal and four skips: not vacuous
