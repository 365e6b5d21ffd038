"""A user's JSONL file (one question and answer per line) to verl's parquet format.

    convert_jsonl("gsm8k/train.jsonl", "data/gsm8k/train.parquet", data_source="openai/gsm8k",
                  answer_pattern="####\\s*(.+)", instruction='Think step by step; give the answer after "####".')

Each line becomes a row: prompt = [system message if given] + one user message holding the
question (followed by the instruction, if any); reward_model.ground_truth = the answer, or the
first group of `answer_pattern` matched in it; extra_info keeps the raw question and answer.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.data.errors import DataError


def jsonl_rows(
    src: str | Path,
    *,
    data_source: str,
    question_key: str = "question",
    answer_key: str = "answer",
    ability: str = "",
    instruction: str = "",
    system_prompt: Optional[str] = None,
    answer_pattern: Optional[str] = None,
    split: str = "train",
) -> list[dict]:
    """verl-format rows of the JSONL file `src`; DataError naming every bad line."""
    path = Path(src)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    pattern = re.compile(answer_pattern) if answer_pattern else None
    if pattern is not None and pattern.groups < 1:
        raise DataError(f"answer pattern {answer_pattern!r} needs a group, e.g. '####\\s*(.+)'")
    rows, problems = [], []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"{path}: line {number}: not JSON ({exc.msg})")
                continue
            if not isinstance(record, dict):
                problems.append(f"{path}: line {number}: expected a JSON object, got {type(record).__name__}")
                continue
            missing = [k for k in (question_key, answer_key) if not isinstance(record.get(k), (str, int, float))]
            if missing:
                problems.append(
                    f"{path}: line {number}: no string or number for {', '.join(repr(k) for k in missing)} "
                    f"(keys: {', '.join(record)}); choose the fields with --question-key/--answer-key"
                )
                continue
            question, answer = str(record[question_key]), str(record[answer_key])
            truth = answer.strip()
            if pattern is not None:
                match = pattern.search(answer)
                if match is None:
                    problems.append(f"{path}: line {number}: answer does not match {answer_pattern!r}: {answer[-80:]!r}")
                    continue
                truth = match.group(1).strip()
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages.append({"role": "user", "content": f"{question} {instruction}" if instruction else question})
            rows.append(
                {
                    "data_source": data_source,
                    "prompt": messages,
                    "ability": ability,
                    "reward_model": {"style": "rule", "ground_truth": truth},
                    "extra_info": {"split": split, "index": len(rows), "question": question, "answer": answer},
                }
            )
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - len(shown)} more bad lines" if len(problems) > len(shown) else ""
        raise DataError("cannot convert:\n" + "\n".join(f"  - {p}" for p in shown) + more)
    if not rows:
        raise DataError(f"{path}: no records")
    return rows


def convert_jsonl(src: str | Path, dst: str | Path, **kwargs) -> int:
    """Write jsonl_rows(src, **kwargs) to the parquet file dst; return the number of rows."""
    rows = jsonl_rows(src, **kwargs)
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    return len(rows)
