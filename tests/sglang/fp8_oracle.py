"""SGLang 0.5.23's own block-FP8 code, from the wheel, on cases a test wrote: the oracle of
megarl.rollout.fp8. Runs under SGLang's interpreter (`real_sglang.sglang_client_env`).

    python fp8_oracle.py CASES OUT

CASES (torch.save): {"dequantize": [(values, scale_inv)], "quantize": [weight],
"skipped": [(prefix, ignored_layers)]}. OUT (torch.save): per case, SGLang's answer:
`layers/quantization/fp8_utils.py::block_quant_dequant` in float32 and bfloat16;
`benchmark/deepseek_utils.py::per_block_cast_to_fp8` (values, scales); and whether
`layers/quantization/utils.py::is_layer_skipped` skips the prefix under `Fp8Config.from_config`'s
reading of the ignored layers (its error message where it raises).
"""
import sys

import torch
from sglang.benchmark.deepseek_utils import per_block_cast_to_fp8
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
from sglang.srt.layers.quantization.utils import is_layer_skipped


def skipped(prefix: str, ignored_layers: list) -> object:
    config = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "ignored_layers": ignored_layers})
    try:
        return is_layer_skipped(prefix, config.ignored_layers, fused_mapping=config.packed_modules_mapping)
    except ValueError as e:
        return str(e)


def main(cases_path: str, out_path: str) -> None:
    cases = torch.load(cases_path)
    torch.save({
        "dequantize": [(block_quant_dequant(q, s, [128, 128], torch.float32),
                        block_quant_dequant(q, s, [128, 128], torch.bfloat16)) for q, s in cases["dequantize"]],
        "quantize": [per_block_cast_to_fp8(w) for w in cases["quantize"]],
        "skipped": [skipped(prefix, ignored) for prefix, ignored in cases["skipped"]],
    }, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
