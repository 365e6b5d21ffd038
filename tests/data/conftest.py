import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.data.tiny_model import build_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


def verl_row(i: int, prompt: str = "12+3=", answer: str = "15") -> dict:
    return {
        "data_source": "megarl/add",
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": i},
    }


@pytest.fixture
def write_rows(tmp_path):
    """write_rows(rows, name="data.parquet") -> path of a parquet file holding `rows`."""

    def write(rows, name="data.parquet"):
        path = tmp_path / name
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path

    return write


@pytest.fixture
def make_rows():
    """make_rows(prompts) -> verl rows, one per prompt text."""

    def make(prompts):
        return [verl_row(i, p) for i, p in enumerate(prompts)]

    return make
