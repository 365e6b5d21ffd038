"""Synthetic tasks: verl-format files that load, fit the quickstart's limits, and score with
the scorer registered for their data_source."""
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.config import load_and_validate
from megarl.data.prompts import PromptDataset
from megarl.data.synthetic import TASKS, write_task_dataset
from megarl.rewards.synthetic import SYNTHETIC_SCORERS, exact_match, strip_response

QUICKSTART = load_and_validate(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml").data


@pytest.fixture(scope="module", params=list(TASKS))
def task_files(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return request.param, write_task_dataset(request.param, out, train_size=300, val_size=64, sft_size=200, seed=3)


def test_files_load_within_the_quickstart_lengths(task_files, char_tokenizer):
    name, paths = task_files
    assert sorted(paths) == ["sft_train", "sft_val", "train", "val"]
    limits = dict(max_prompt_length=QUICKSTART.max_prompt_length, filter_overlong_prompts=False, truncation="error")
    train = PromptDataset(paths["train"], char_tokenizer, **limits)
    val = PromptDataset(paths["val"], char_tokenizer, **limits)
    sft = PromptDataset(
        paths["sft_train"], char_tokenizer, response_key="response", max_response_length=QUICKSTART.max_response_length, **limits
    )
    assert (len(train), len(val), len(sft)) == (300, 64, 200)
    row = train[0].row
    assert row.data_source == f"megarl/{name}" and row.reward_model["style"] == "rule"
    assert row.extra_info == {"split": "train", "index": 0} and row.ability == TASKS[name].ability
    assert sft[5].response_ids[-1] == char_tokenizer.eos_token_id
    assert char_tokenizer.decode(sft[5].response_ids[:-1]) == sft[5].row.ground_truth == sft[5].row.response


def test_validation_prompts_are_distinct_and_never_trained_on(task_files):
    _, paths = task_files
    prompts = {split: [r["prompt"][0]["content"] for r in pq.read_table(p).to_pylist()] for split, p in paths.items()}
    assert len(set(prompts["val"])) == len(prompts["val"]) == 64
    assert prompts["sft_val"] == prompts["val"]
    assert not set(prompts["val"]) & (set(prompts["train"]) | set(prompts["sft_train"]))


def test_ground_truths_are_right_and_score_one(task_files):
    name, paths = task_files
    for row in pq.read_table(paths["train"]).to_pylist():
        prompt, truth = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
        if name == "add":
            a, b = prompt.rstrip("=").split("+")
            assert truth == str(int(a) + int(b))
        elif name == "rev":
            assert prompt.endswith(">") and truth == prompt[:-1][::-1]
        else:
            assert prompt.endswith(":") and truth == "".join(sorted(prompt[:-1]))
        scorer = SYNTHETIC_SCORERS[row["data_source"]]
        assert scorer(truth + "<eos>", truth) == 1.0
        assert scorer(truth + "9", truth) == 0.0


def test_same_seed_same_files(tmp_path):
    a = write_task_dataset("rev", tmp_path / "a", train_size=50, val_size=10, sft_size=0, seed=1)
    b = write_task_dataset("rev", tmp_path / "b", train_size=50, val_size=10, sft_size=0, seed=1)
    c = write_task_dataset("rev", tmp_path / "c", train_size=50, val_size=10, sft_size=0, seed=2)
    assert sorted(a) == ["train", "val"]
    assert pq.read_table(a["train"]).equals(pq.read_table(b["train"]))
    assert not pq.read_table(a["train"]).equals(pq.read_table(c["train"]))


def test_every_task_has_a_registered_scorer():
    assert {task.data_source for task in TASKS.values()} == set(SYNTHETIC_SCORERS)


@pytest.mark.parametrize(
    "response, expected",
    [("68", 1.0), (" 68\n", 1.0), ("68<eos><pad><pad>", 1.0), ("68</s>", 1.0), ("68<|im_end|>", 1.0),
     ("68<eos>68", 1.0), ("6", 0.0), ("86", 0.0), ("68 1", 0.0), ("", 0.0), ("<eos>68", 0.0)],
)
def test_exact_match(response, expected):
    assert exact_match(response, "68") == expected


def test_strip_response():
    assert strip_response("  abc <eos> junk") == "abc"


def test_too_many_validation_prompts_for_the_task(tmp_path):
    with pytest.raises(ValueError, match="too few distinct prompts for 20000 validation examples"):
        write_task_dataset("add", tmp_path, val_size=20_000)


CALIBRATION = {  # the first three draws of random.Random(0) in shared/reference/tiny_grpo.py's tasks
    "add": [("49+97=", "146"), ("53+5=", "58"), ("33+65=", "98")],
    "rev": [("ynbiq>", "qibny"), ("mzjpl>", "lpjzm"), ("gqejey>", "yejeqg")],
    "sort": [("66048:", "04668"), ("76475:", "45677"), ("93824:", "23489")],
}


@pytest.mark.parametrize("name", list(CALIBRATION))
def test_tasks_draw_exactly_what_the_calibration_drew(name):
    rng = random.Random(0)
    assert [TASKS[name].make(rng) for _ in range(3)] == CALIBRATION[name]
