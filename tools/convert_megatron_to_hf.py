#!/usr/bin/env python
"""Convert a megatron-core `torch_dist` checkpoint of a Llama / Mistral / Qwen2 / Qwen3 model, or of
a Qwen2-MoE / Qwen3-MoE / Mixtral mixture-of-experts model, into an HF checkpoint (config.json, sharded safetensors with an index, tokenizer files), one tensor
at a time.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--hf-config DIR]

--ckpt is a checkpoint root (with latest_checkpointed_iteration.txt) or an iteration directory,
saved at any TP / PP / VPP / EP layout. The config and tokenizer come from --hf-config, else from the
`hf/` directory that tools/convert_hf_to_megatron.py stored in the checkpoint. The output loads
with transformers and SGLang. Exit status: 0 done, 2 the input cannot be converted exactly (the
message says why), 1 an unexpected error.
"""
import argparse
import re
import sys
import time

from megarl.bridge import ConversionError
from megarl.bridge.convert import progress_bar, convert_torch_dist_to_hf

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000; '512MiB' -> 536870912; '1000' -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="megatron torch_dist checkpoint (root or iteration directory)")
    parser.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    parser.add_argument("--hf-config", default=None, help="HF directory with config.json and tokenizer files")
    parser.add_argument("--max-shard-size", type=parse_size, default="5GB",
                        help="largest safetensors file (default 5GB); bounds the memory used")
    args = parser.parse_args(argv)

    start = time.monotonic()
    try:
        with progress_bar("megatron -> hf") as show:
            summary = convert_torch_dist_to_hf(args.ckpt, args.out, args.hf_config, args.max_shard_size, show)
    except ConversionError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.tensors} megatron tensors ({summary.bytes / 2**20:.1f} MiB) as HF to {summary.out} "
          f"in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
