#!/usr/bin/env python
"""Convert a JSONL file of questions and answers to verl-format parquet.

    python tools/convert_jsonl.py gsm8k/train.jsonl data/gsm8k/train.parquet \\
        --data-source openai/gsm8k --ability math --answer-pattern '####\\s*(.+)' \\
        --instruction 'Think step by step; give the final answer after "####".'

The logic is megarl.data.convert.convert_jsonl; a bad line is reported by number.
"""
import argparse
import sys

from megarl.data.convert import convert_jsonl
from megarl.data.errors import DataError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="input .jsonl")
    p.add_argument("dst", help="output .parquet")
    p.add_argument("--data-source", required=True, help="the rows' data_source: picks the reward function")
    p.add_argument("--question-key", default="question")
    p.add_argument("--answer-key", default="answer")
    p.add_argument("--ability", default="")
    p.add_argument("--instruction", default="", help="text appended to each question")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--answer-pattern", default=None, help="regex whose first group is the ground truth")
    p.add_argument("--split", default="train", help="stored in extra_info.split")
    a = p.parse_args(argv)
    try:
        n = convert_jsonl(
            a.src, a.dst, data_source=a.data_source, question_key=a.question_key, answer_key=a.answer_key,
            ability=a.ability, instruction=a.instruction, system_prompt=a.system_prompt,
            answer_pattern=a.answer_pattern, split=a.split,
        )
    except DataError as exc:
        print(f"convert_jsonl: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {a.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
