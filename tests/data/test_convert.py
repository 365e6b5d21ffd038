"""A user's JSONL to verl parquet, then through the normal loader."""
import json

import pytest

from megarl.data.convert import convert_jsonl
from megarl.data.errors import DataError
from megarl.data.parquet import read_rows

GSM8K_LINES = [
    {"question": "Tom has 3 pens and buys 4. How many pens?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_gsm8k_style_file_converts_and_loads(tmp_path):
    src = write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    n = convert_jsonl(
        src, tmp_path / "out" / "train.parquet", data_source="openai/gsm8k", ability="math",
        answer_pattern=r"####\s*(.+)", instruction="Answer after ####.", system_prompt="Be brief.",
    )
    assert n == 2
    rows = read_rows(tmp_path / "out" / "train.parquet")
    assert [r.ground_truth for r in rows] == ["7", "42"]
    assert rows[1].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 times 7? Answer after ####."},
    ]
    assert rows[0].data_source == "openai/gsm8k" and rows[0].ability == "math"
    assert rows[1].extra_info == {"split": "train", "index": 1, "question": GSM8K_LINES[1]["question"], "answer": GSM8K_LINES[1]["answer"]}


def test_other_field_names(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1", "solution": 2}])
    convert_jsonl(src, tmp_path / "d.parquet", data_source="mine", question_key="problem", answer_key="solution")
    (row,) = read_rows(tmp_path / "d.parquet")
    assert row.messages == [{"role": "user", "content": "1+1"}] and row.ground_truth == "2"


def test_bad_lines_are_named(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(
        json.dumps(GSM8K_LINES[0]) + "\n"
        + "{not json\n"
        + json.dumps({"q": "x", "answer": "#### 1"}) + "\n"
        + json.dumps({"question": "x", "answer": "no marker"}) + "\n"
    )
    with pytest.raises(DataError) as err:
        convert_jsonl(src, tmp_path / "out.parquet", data_source="d", answer_pattern=r"####\s*(.+)")
    message = str(err.value)
    assert f"{src}: line 2: not JSON" in message
    assert f"{src}: line 3: no string or number for 'question' (keys: q, answer)" in message
    assert f"{src}: line 4: answer does not match" in message
    assert not (tmp_path / "out.parquet").exists()


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no records"):
        convert_jsonl(tmp_path / "empty.jsonl", tmp_path / "o.parquet", data_source="d")
    with pytest.raises(DataError, match="missing.jsonl: file not found"):
        convert_jsonl(tmp_path / "missing.jsonl", tmp_path / "o.parquet", data_source="d")
