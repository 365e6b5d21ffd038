"""Preference pairs: the synthetic generator, the reader, its length rules and its error messages."""
import random

import pyarrow.parquet as pq
import pytest

from megarl.data.errors import DataError
from megarl.data.preferences import PreferenceDataset, pairs_to_batch
from megarl.data.synthetic import TASKS, near_miss, write_task_dataset
from megarl.rewards.synthetic import SYNTHETIC_SCORERS


def pref_row(i, prompt="12+3=", chosen="15", rejected="16"):
    return {"data_source": "megarl/add", "prompt": [{"role": "user", "content": prompt}], "chosen": chosen,
            "rejected": rejected, "extra_info": {"index": i}}


# ------------------------------------------------------------------ synthetic generator
def test_near_miss_is_wrong_but_close():
    rng = random.Random(0)
    for answer in ["0", "1", "57", "198"]:
        for _ in range(50):
            miss = near_miss(answer, rng)
            assert miss.isdigit() and miss != answer and 1 <= abs(int(miss) - int(answer)) <= 3
    for answer in ["dbqk", "11345"]:
        for _ in range(50):
            miss = near_miss(answer, rng)
            assert len(miss) == len(answer) and sum(a != b for a, b in zip(miss, answer)) == 1


@pytest.mark.parametrize("task", list(TASKS))
def test_synthetic_preferences(task, tmp_path, char_tokenizer):
    paths = write_task_dataset(task, tmp_path / "p", train_size=50, val_size=20, sft_size=30, pref_size=40, seed=2)
    plain = write_task_dataset(task, tmp_path / "q", train_size=50, val_size=20, sft_size=30, seed=2)
    assert sorted(paths) == ["prefs_train", "prefs_val", "sft_train", "sft_val", "train", "val"]
    for name, path in plain.items():  # the other outputs are unchanged by the preference task
        assert pq.read_table(paths[name]).equals(pq.read_table(path)), name
    rows = {split: pq.read_table(paths[split]).to_pylist() for split in ("prefs_train", "prefs_val", "val")}
    assert len(rows["prefs_train"]) == 40
    assert [r["prompt"] for r in rows["prefs_val"]] == [r["prompt"] for r in rows["val"]]
    prompts = {split: {r["prompt"][0]["content"] for r in rows[split]} for split in rows}
    assert not prompts["val"] & prompts["prefs_train"]
    scorer = SYNTHETIC_SCORERS[f"megarl/{task}"]
    for row in rows["prefs_train"] + rows["prefs_val"]:
        truth = row["reward_model"]["ground_truth"]
        assert row["chosen"] == truth and scorer(row["chosen"], truth) == 1.0
        assert row["rejected"] != truth and scorer(row["rejected"], truth) == 0.0
    pairs = PreferenceDataset(paths["prefs_train"], char_tokenizer, max_prompt_length=16, max_response_length=8,
                              filter_overlong_prompts=False)
    assert len(pairs) == 40 and pairs.num_filtered == 0


# ------------------------------------------------------------------ reader
def test_reader_tokenises_pairs_and_lays_out_batches(write_rows, char_tokenizer):
    path = write_rows([pref_row(0), pref_row(1, prompt="7+8=", chosen="15", rejected="105")])
    pairs = PreferenceDataset(path, char_tokenizer)
    eos = char_tokenizer.eos_token_id
    assert len(pairs) == 2 and pairs[1].index == 1 and pairs[1].row.extra_info == {"index": 1}
    assert char_tokenizer.decode(pairs[1].prompt_ids) == "<bos>7+8="
    assert pairs[1].chosen_ids[-1] == eos and char_tokenizer.decode(pairs[1].chosen_ids[:-1]) == "15"
    assert pairs[1].rejected_ids[-1] == eos and char_tokenizer.decode(pairs[1].rejected_ids[:-1]) == "105"
    batch = pairs_to_batch(pairs.take([0, 1]))
    assert len(batch) == 4
    responses = [char_tokenizer.decode(ids[mask.bool()])
                 for ids, mask in zip(batch["response_ids"], batch["response_mask"])]
    assert responses == ["15<eos>", "16<eos>", "15<eos>", "105<eos>"]
    assert batch["prompt_ids"][2].tolist() == batch["prompt_ids"][3].tolist()


def test_custom_column_names_and_string_prompts(write_rows, char_tokenizer):
    path = write_rows([{"question": "1+1=", "good": "2", "bad": "3"}])
    pairs = PreferenceDataset(path, char_tokenizer, prompt_key="question", chosen_key="good", rejected_key="bad")
    assert char_tokenizer.decode(pairs[0].rejected_ids) == "3<eos>" and pairs[0].row.messages[0]["role"] == "user"


def test_missing_columns_are_named_with_the_file(write_rows, char_tokenizer):
    path = write_rows([{"prompt": "1+1=", "data_source": "x"}])
    with pytest.raises(DataError) as err:
        PreferenceDataset(path, char_tokenizer)
    assert str(path) in str(err.value) and "'chosen', 'rejected'" in str(err.value)


@pytest.mark.parametrize("column", ["chosen", "rejected"])
def test_empty_responses_name_file_row_and_column(write_rows, char_tokenizer, column):
    rows = [pref_row(0), pref_row(1), pref_row(2)]
    rows[2][column] = ""
    path = write_rows(rows)
    with pytest.raises(DataError, match=rf"{path}: row 2, column '{column}': expected a non-empty"):
        PreferenceDataset(path, char_tokenizer)


def test_overlong_pairs_are_filtered_truncated_or_refused(write_rows, char_tokenizer):
    rows = [pref_row(0), pref_row(1, rejected="123456"), pref_row(2, chosen="99999"), pref_row(3, prompt="1234567+1=")]
    path = write_rows(rows)
    limits = dict(max_prompt_length=8, max_response_length=4)
    kept = PreferenceDataset(path, char_tokenizer, filter_overlong_prompts=True, **limits)
    assert (len(kept), kept.num_filtered, kept[0].row.row) == (1, 3, 0)
    cut = PreferenceDataset(path, char_tokenizer, filter_overlong_prompts=False, truncation="left", **limits)
    assert len(cut) == 4 and char_tokenizer.decode(cut[1].rejected_ids) == "1234"  # responses keep their start
    assert char_tokenizer.decode(cut[3].prompt_ids) == "34567+1="  # prompts per data.truncation
    short_prompts = write_rows(rows[:2], "short_prompts.parquet")
    with pytest.raises(DataError, match=rf"column 'rejected': 1 of 2 longer than data.max_response_length=4 "
                                        rf"tokens \(first: {short_prompts} row 1"):
        PreferenceDataset(short_prompts, char_tokenizer, filter_overlong_prompts=False, truncation="error", **limits)
    with pytest.raises(DataError, match="no pairs .* are within the length limits"):
        PreferenceDataset(write_rows(rows[1:3], "all_long.parquet"), char_tokenizer, **limits)
