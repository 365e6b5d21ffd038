"""reasoning-gym's tasks as a megarl data source: rows written from the library, scored by the task's own
score_answer. The oracle is reasoning-gym itself: entries made by `create_dataset` here, scored by that
dataset's `score_answer` on the answer `reasoning_gym.utils.extract_answer` reads (the whole response,
cut at the tiny tokenizer's <eos> or <pad>, where it holds no tags: docs/environments.md)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import reasoning_gym
from reasoning_gym.utils import extract_answer

from megarl.config.errors import ConfigError
from megarl.data.reasoning_gym import write_reasoning_gym_dataset
from megarl.rewards.batch import score_batch
from megarl.rewards.dispatch import default_compute_score
from megarl.rewards.reasoning_gym import SUPPORTED

REPO = Path(__file__).resolve().parents[2]
TASK, CONFIG = "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def library_score(task: str, config: dict, seed: int, size: int, index: int, response: str) -> float:
    """reasoning-gym's own score of `response` on entry `index` of the dataset it makes for these settings."""
    dataset = reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    answer = extract_answer(response)
    if answer is None:  # the whole response up to the tiny tokenizer's <eos> or <pad>, stripped
        answer = re.split("<eos>|<pad>", response)[0].strip()
    return dataset.score_answer(answer, dataset[index])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("rg")
    write_reasoning_gym_dataset(TASK, out, train_size=64, val_size=8, seed=3, config=CONFIG)
    return out


def test_rows_hold_the_librarys_entries(data):
    rows = pq.read_table(data / "train.parquet").to_pylist()
    dataset = reasoning_gym.create_dataset(TASK, seed=3, size=64, **CONFIG)
    assert len(rows) == 64
    for index in (0, 17, 63):
        row, entry = rows[index], dataset[index]
        assert row["data_source"] == "reasoning_gym/chain_sum" and row["ability"] == dataset.category
        assert row["prompt"] == [{"role": "user", "content": entry["question"]}]
        assert row["reward_model"]["ground_truth"] == entry["answer"]
        assert json.loads(row["extra_info"]["reasoning_gym"]["entry"]) == json.loads(json.dumps(entry))
    val = pq.read_table(data / "val.parquet").to_pylist()
    assert [r["prompt"][0]["content"] for r in val] == [reasoning_gym.create_dataset(TASK, seed=4, size=8, **CONFIG)[i]
                                                        ["question"] for i in range(8)]


@pytest.mark.parametrize("task,config", [(TASK, CONFIG), ("spell_backward", {}), ("count_bits", {})])
def test_scores_equal_the_librarys_on_good_bad_and_partial_answers(tmp_path, task, config):
    write_reasoning_gym_dataset(task, tmp_path, train_size=4, val_size=1, seed=5, config=config)
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    for index, row in enumerate(rows):
        answer = row["reward_model"]["ground_truth"]
        responses = [f"think<answer>{answer}</answer><eos>", f"{answer}<eos>", "<answer>wrong</answer>",
                     f"x{answer}x", "", f"<answer>{answer}0</answer>", f" {answer}<pad>9<eos>"]
        for response in responses:
            ours = default_compute_score(row["data_source"], response, answer, row["extra_info"])
            assert ours == library_score(task, config, 5, 4, index, response), (task, response)
        assert default_compute_score(row["data_source"], responses[0], answer, row["extra_info"]) == 1.0
        assert default_compute_score(row["data_source"], responses[2], answer, row["extra_info"]) < 1.0


def test_an_unknown_task_is_told_with_close_names_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match=r"no task 'chain_sun'; close names: chain_sum"):
        write_reasoning_gym_dataset("chain_sun", tmp_path, train_size=4, val_size=1)
    tool = subprocess.run([sys.executable, str(REPO / "tools/make_dataset.py"), "--task", "reasoning_gym:spell_backwards",
                           "--out", str(tmp_path)], check=False, capture_output=True, text=True, timeout=120)
    assert tool.returncode == 2 and "close names: spell_backward" in tool.stderr, tool.stderr
    assert list(tmp_path.iterdir()) == []


def recipe_config(*overrides: str):
    from megarl.config import load_and_validate

    return load_and_validate(str(REPO / "configs/tiny/grpo_reasoning_gym.yaml"),
                             ["actor_rollout_ref.model.path=unused", *overrides])


def test_the_data_source_key_writes_the_librarys_entries_once(tmp_path):
    """data.source=reasoning_gym:<task> (the recipe's): the files the run then reads hold the entries reasoning-gym
    makes for the source keys (train: source_seed, val: source_seed + 1); a second start reuses them."""
    from megarl.trainer.preflight import with_source_files

    config = with_source_files(recipe_config(f"data.source_dir={tmp_path}", "data.source_seed=3",
                                             "data.source_train_size=4", "data.source_val_size=2"))
    assert config.data.train_files == [str(tmp_path / "train.parquet")]
    assert config.data.val_files == [str(tmp_path / "val.parquet")]
    for path, seed, size in ((tmp_path / "train.parquet", 3, 4), (tmp_path / "val.parquet", 4, 2)):
        entries = reasoning_gym.create_dataset(TASK, seed=seed, size=size, **CONFIG)
        rows = pq.read_table(path).to_pylist()
        assert [r["prompt"][-1]["content"] for r in rows] == [entries[i]["question"] for i in range(size)]
        assert [r["reward_model"]["ground_truth"] for r in rows] == [str(entries[i]["answer"]) for i in range(size)]
    written = (tmp_path / "train.parquet").stat().st_mtime_ns
    with_source_files(recipe_config(f"data.source_dir={tmp_path}", "data.source_seed=3",
                                    "data.source_train_size=4", "data.source_val_size=2"))
    assert (tmp_path / "train.parquet").stat().st_mtime_ns == written


def test_an_unknown_task_in_the_config_is_told_before_anything_starts(tmp_path):
    """The check main_ppo runs before Ray or any server (also --dry-run) names the task and its close names."""
    from megarl.trainer.preflight import check_environment

    config = recipe_config("data.source=reasoning_gym:chain_sun", f"trainer.default_local_dir={tmp_path}")
    with pytest.raises(ConfigError, match=r"no task 'chain_sun'; close names: chain_sum"):
        check_environment(config, "rl")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match=r"data.source='reasoning_gym:chain_sum' writes the train and val files"):
        recipe_config("data.train_files=[a.parquet]")
    with pytest.raises(ConfigError, match=r"data.source='rg:chain_sum': give reasoning_gym:<task>"):
        recipe_config("data.source=rg:chain_sum")


def test_a_config_the_task_refuses_is_told_with_the_task(tmp_path):
    with pytest.raises(ConfigError, match=r"reasoning-gym task 'chain_sum' refuses config \{\"min_term\": 2\}"):
        write_reasoning_gym_dataset(TASK, tmp_path, train_size=4, val_size=1, config={"min_term": 2})


def test_the_supported_range_is_setup_pys(supported_range_is_setup_pys):
    supported_range_is_setup_pys("reasoning-gym", SUPPORTED)


@pytest.mark.parametrize("version,message", [(None, "not installed"), ("0.2.0", "reasoning-gym 0.2.0 is installed")])
def test_a_missing_or_unsupported_library_is_told_with_the_fix(installed_version, tmp_path, version, message):
    installed_version("reasoning-gym", version)
    with pytest.raises(ConfigError, match=f"{message}.*pip install 'megarl\\[envs\\]'"):
        write_reasoning_gym_dataset(TASK, tmp_path, train_size=4, val_size=1)


def test_a_row_the_installed_library_would_not_make_costs_its_sample_only(data):
    rows = pq.read_table(data / "train.parquet").to_pylist()[:3]
    rows[1]["extra_info"]["reasoning_gym"]["index"] = 2  # another entry than the one written: another question
    good = [f"<answer>{r['reward_model']['ground_truth']}</answer>" for r in rows]
    batch = score_batch(default_compute_score, [r["data_source"] for r in rows], good,
                        [r["reward_model"]["ground_truth"] for r in rows], [r["extra_info"] for r in rows])
    assert batch.scores.tolist() == [1.0, 0.0, 1.0] and batch.metrics["reward/num_errors"] == 1.0


@pytest.mark.slow
def test_grpo_on_a_reasoning_gym_task_records_the_librarys_scores(tmp_path):
    """2 GRPO steps of the tiny model on chain_sum (the recipe configs/tiny/grpo_reasoning_gym.yaml, its data
    written by the run from data.source): every
    score of the run (8 prompts x 4 responses per step; 8 validation prompts greedy and sampled, before and
    after) is reasoning-gym's own on the response, and each step's reward/mean is the mean of its scores."""
    from megarl.data.tiny_model import make_tiny_model
    from megarl.testing import run_to_completion

    make_tiny_model("qwen2", tmp_path / "model", seed=0)
    record = tmp_path / "scores.jsonl"
    recipe = REPO / "configs/tiny/grpo_reasoning_gym.yaml"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(recipe),
           f"actor_rollout_ref.model.path={tmp_path / 'model'}", f"data.source_dir={tmp_path / 'data'}",
           "data.source_seed=3", "data.source_train_size=64", "data.source_val_size=8",
           f"trainer.default_local_dir={tmp_path / 'out'}",
           f"custom_reward_function.path={Path(__file__).with_name('recording_reward.py')}",
           f"+custom_reward_function.reward_kwargs.record={record}"]
    run_to_completion(cmd, tmp_path, 400, "GRPO on reasoning_gym/chain_sum")
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    train_scores = [c["score"] for c in calls if c["extra_info"]["split"] == "train"]
    assert len(train_scores) == 2 * 8 * 4 and len(calls) == len(train_scores) + 2 * 2 * 8
    for call in calls:
        info = call["extra_info"]["reasoning_gym"]
        assert call["score"] == library_score(TASK, CONFIG, info["seed"], info["size"], info["index"],
                                              call["solution_str"]), call
    metrics = [json.loads(line) for line in
               (tmp_path / "out/megarl-tiny/grpo_reasoning_gym/logs/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "timing/step_s" in m]
    means = [sum(train_scores[:32]) / 32, sum(train_scores[32:]) / 32]
    assert [m["reward/mean"] for m in steps] == pytest.approx(means)
