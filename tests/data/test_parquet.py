"""Reading verl-format parquet: files written by pandas/pyarrow load unchanged; bad input fails
at once naming file, row and column."""
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import ConfigError
from megarl.data.errors import DataError
from megarl.data.parquet import read_rows

GSM8K_LIKE = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "You are a careful solver."},
            {"role": "user", "content": "Janet has 3 apples and buys 4. How many? Answer after ####."},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 0, "answer": "3+4=7 #### 7", "question": "Janet has 3 apples..."},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 6 times 7?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"split": "train", "index": 1, "answer": "6*7=42 #### 42", "question": "What is 6 times 7?"},
    },
]


def test_pandas_written_verl_parquet_loads_unchanged(tmp_path):
    path = tmp_path / "gsm8k.parquet"
    pd.DataFrame(GSM8K_LIKE, index=[10, 11]).to_parquet(path)  # non-default index: an extra index column
    rows = read_rows(path)
    assert len(rows) == 2
    for row, original in zip(rows, GSM8K_LIKE):
        assert row.messages == original["prompt"]
        assert row.data_source == original["data_source"]
        assert row.ability == original["ability"]
        assert row.reward_model == original["reward_model"]
        assert row.ground_truth == original["reward_model"]["ground_truth"]
        assert row.extra_info == original["extra_info"]
        assert row.response is None
    assert (rows[1].file, rows[1].row) == (str(path), 1)


def test_large_types_map_columns_and_missing_optional_columns(tmp_path):
    """HF datasets may write large_string/large_list; extra_info may be a map; ability and extra_info are optional."""
    message = pa.struct([("content", pa.large_string()), ("role", pa.large_string())])
    schema = pa.schema(
        [
            ("data_source", pa.large_string()),
            ("prompt", pa.large_list(message)),
            ("reward_model", pa.struct([("ground_truth", pa.list_(pa.string())), ("style", pa.string())])),
            ("extra_info", pa.map_(pa.string(), pa.string())),
        ]
    )
    table = pa.Table.from_pylist(
        [
            {
                "data_source": "x",
                "prompt": [{"content": "hi", "role": "user"}],
                "reward_model": {"ground_truth": ["a", "b"], "style": "rule"},
                "extra_info": [("k", "v")],
            }
        ],
        schema=schema,
    )
    pq.write_table(table, tmp_path / "large.parquet")
    (row,) = read_rows(tmp_path / "large.parquet")
    assert row.messages == [{"content": "hi", "role": "user"}]
    assert row.ground_truth == ["a", "b"]
    assert row.extra_info == {"k": "v"}
    assert row.ability == ""


def test_plain_text_prompt_column(write_rows):
    path = write_rows([{"data_source": "d", "question": "2+2=", "reward_model": {"style": "rule", "ground_truth": "4"}}])
    (row,) = read_rows(path, prompt_key="question")
    assert row.messages == [{"role": "user", "content": "2+2="}]


def test_several_files_are_concatenated_in_order(write_rows, make_rows):
    a = write_rows(make_rows(["1+1=", "2+2="]), "a.parquet")
    b = write_rows(make_rows(["3+3="]), "b.parquet")
    rows = read_rows([a, b])
    assert [r.messages[0]["content"] for r in rows] == ["1+1=", "2+2=", "3+3="]
    assert [(r.file, r.row) for r in rows] == [(str(a), 0), (str(a), 1), (str(b), 0)]


def test_sft_rows_need_the_response_column_not_reward_model(write_rows):
    path = write_rows([{"prompt": [{"role": "user", "content": "1+1="}], "response": "2"}])
    (row,) = read_rows(path, response_key="response")
    assert row.response == "2" and row.reward_model == {} and row.data_source == ""
    with pytest.raises(DataError, match=r"missing column\(s\) 'data_source', 'reward_model'"):
        read_rows(path)


# ---------------------------------------------------------------------------------- bad input
def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet: file not found"):
        read_rows(tmp_path / "nope.parquet")


def test_no_files():
    with pytest.raises(DataError, match="no data files given"):
        read_rows([])


def test_not_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text('{"prompt": "this is JSON, not parquet"}\n')
    with pytest.raises(DataError, match=r"train\.parquet: not a readable parquet file"):
        read_rows(path)


def test_zero_byte_file(tmp_path):
    path = tmp_path / "empty.parquet"
    path.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.parquet: not a readable parquet file"):
        read_rows(path)


def test_parquet_without_rows(tmp_path, make_rows):
    table = pa.Table.from_pylist(make_rows(["1+1="]))
    pq.write_table(table.slice(0, 0), tmp_path / "norows.parquet")
    with pytest.raises(DataError, match=r"norows\.parquet: the file has no rows"):
        read_rows(tmp_path / "norows.parquet")


def test_missing_column_names_file_and_column(write_rows, make_rows):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in make_rows(["1+1="])]
    path = write_rows(rows)
    with pytest.raises(DataError) as err:
        read_rows(path)
    assert f"{path}: missing column(s) 'reward_model'" in str(err.value)
    assert "columns present: data_source, prompt, ability, extra_info" in str(err.value)


def test_prompt_key_names_the_missing_column(write_rows, make_rows):
    path = write_rows(make_rows(["1+1="]))
    with pytest.raises(DataError, match=r"missing column\(s\) 'question'"):
        read_rows(path, prompt_key="question")


@pytest.mark.parametrize(
    "column, bad_value, expected",
    [
        ("prompt", None, "expected a non-empty list of {role, content} chat messages or a string, got NoneType"),
        ("prompt", [], "expected a non-empty list"),
        ("prompt", [{"role": "user", "content": None}], "message 0: 'content' must be a string"),
        ("prompt", [{"role": None, "content": "x"}], "message 0: 'role' must be a string"),
        ("data_source", None, "expected a non-empty string"),
        ("reward_model", {"style": "rule", "ground_truth": None}, "'ground_truth' is missing or null"),
        ("reward_model", None, "expected a {style, ground_truth} dict"),
    ],
)
def test_bad_row_names_file_row_and_column(write_rows, make_rows, column, bad_value, expected):
    rows = make_rows(["1+1=", "2+2=", "3+3=", "4+4="])
    rows[2][column] = bad_value
    path = write_rows(rows)
    with pytest.raises(DataError) as err:
        read_rows(path)
    assert f"{path}: row 2, column '{column}': {expected}" in str(err.value)


def test_wrong_column_type_reports_every_bad_row(write_rows, make_rows):
    rows = make_rows(["1+1=", "2+2=", "3+3="])
    for i, row in enumerate(rows):
        row["data_source"] = i  # an int64 column
    path = write_rows(rows)
    with pytest.raises(DataError) as err:
        read_rows(path)
    assert f"{path}: row 0, column 'data_source': expected a non-empty string, got int 0 (3 bad rows in this column: 0, 1, 2)" in str(err.value)


def test_reward_model_may_lack_ground_truth_for_model_style(write_rows, make_rows):
    rows = make_rows(["1+1="])
    rows[0]["reward_model"] = {"style": "model", "ground_truth": None}
    (row,) = read_rows(write_rows(rows))
    assert row.ground_truth is None


def test_every_problem_in_every_file_is_reported_at_once(tmp_path, write_rows, make_rows):
    good = write_rows(make_rows(["1+1="]), "good.parquet")
    rows = make_rows(["1+1=", "2+2="])
    rows[1]["prompt"] = None
    rows[0]["reward_model"] = {"style": "rule", "ground_truth": None}
    bad = write_rows(rows, "bad.parquet")
    with pytest.raises(DataError) as err:
        read_rows([good, tmp_path / "missing.parquet", bad])
    message = str(err.value)
    assert "missing.parquet: file not found" in message
    assert f"{bad}: row 1, column 'prompt'" in message
    assert f"{bad}: row 0, column 'reward_model'" in message
    assert str(good) not in message
    assert isinstance(err.value, ConfigError)  # entry points print it and exit 2
