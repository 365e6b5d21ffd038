#!/usr/bin/env python
"""Convert an HF safetensors checkpoint (Llama, Mistral, Qwen2, Qwen3; mixture-of-experts Qwen2-MoE,
Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3 and GLM-4.5 with their multi-token-prediction layers; the list
is `megarl.bridge.arch.FAMILIES`) into a megatron-core `torch_dist` checkpoint, one tensor at a time.

    python tools/convert_hf_to_megatron.py --hf DIR --out DIR [--tp N --pp N --vpp N --ep N --etp N]

The output (`OUT/latest_checkpointed_iteration.txt` -> `OUT/release/`) loads into a stock
megatron-core `GPTModel` (`dist_checkpointing.load(model.sharded_state_dict(), OUT/release)`) at
the given layout. The layout is checked against the config and fixes the padded vocabulary (a
multiple of --make-vocab-size-divisible-by x TP); megatron reshards at load time, so the
checkpoint also loads at other layouts (the vocabulary rows are zero-padded or trimmed). The HF
config and tokenizer are kept in `OUT/release/hf/`. Exit status: 0 done, 2 the input cannot be
converted exactly (the message says why), 1 an unexpected error.
"""
import argparse
import sys
import time

from megarl.bridge import ConversionError, ParallelLayout
from megarl.bridge.convert import progress_bar, convert_hf_to_torch_dist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size the checkpoint is made for")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline rank (virtual pipeline)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    parser.add_argument("--etp", type=int, default=0, help="expert tensor-parallel size: 1, or TP (0, the default)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="megatron pads the vocabulary to a multiple of this times TP (default 128)")
    args = parser.parse_args(argv)

    start = time.monotonic()
    try:
        with progress_bar("hf -> megatron") as show:
            layout = ParallelLayout(args.tp, args.pp, args.vpp, args.ep, args.etp)
            summary = convert_hf_to_torch_dist(args.hf, args.out, layout, args.make_vocab_size_divisible_by, show)
    except ConversionError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    print(f"wrote {summary.tensors} tensors ({summary.bytes / 2**20:.1f} MiB) for {layout} to {summary.out} "
          f"in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
