"""The controller's side of the OPD teacher (megarl.trainer.teacher): the tokenizer check at load
time, and how a batch becomes scoring requests and their answers a [B, R] grid (a multi-turn row
included), checked against rows written out by hand."""
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from megarl.config import ConfigError
from megarl.data.batch import Batch
from megarl.data.tiny_model import build_char_tokenizer
from megarl.trainer.teacher import check_same_tokenizer, response_grid, scoring_requests


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    build_char_tokenizer().save_pretrained(root / "student")
    build_char_tokenizer().save_pretrained(root / "same")
    added = build_char_tokenizer()
    added.add_tokens(["<tool>"])
    added.save_pretrained(root / "added")
    other_eos = AutoTokenizer.from_pretrained(root / "student")
    other_eos.eos_token = "<unk>"
    other_eos.save_pretrained(root / "other_eos")
    return root


def test_the_same_tokenizer_is_accepted(tokenizers):
    check_same_tokenizer(str(tokenizers / "student"), str(tokenizers / "same"))


@pytest.mark.parametrize("teacher, why", [("added", "vocabularies differ (47 vs 48 tokens, 1 (token, id) pairs"),
                                          ("other_eos", "eos_token_id 2 vs 3")])
def test_another_tokenizer_is_refused_naming_both_paths(tokenizers, teacher, why):
    with pytest.raises(ConfigError) as info:
        check_same_tokenizer(str(tokenizers / "student"), str(tokenizers / teacher))
    message = str(info.value)
    assert f"distillation.teacher.model_path='{tokenizers / teacher}'" in message
    assert f"'{tokenizers / 'student'}'" in message and why in message


def batch() -> Batch:
    """Row 0: prompt [7, 8], response [9, 10, 11]. Row 1: prompt [5], a multi-turn response
    [12, 13 (tool), 14 (tool), 15], its loss mask 1 0 0 1."""
    b = Batch.from_token_lists([[7, 8], [5]], [[9, 10, 11], [12, 13, 14, 15]])
    b["response_attention_mask"] = b["response_mask"].clone()
    b["response_mask"] = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 1]])
    return b


def test_every_row_is_scored_whole_from_its_last_prompt_token():
    sequences, starts = scoring_requests(batch())
    assert sequences == [[7, 8, 9, 10, 11], [5, 12, 13, 14, 15]]
    assert starts == [1, 0]  # the input log-probs from there on are the response tokens'


def test_the_answers_line_up_with_the_response_columns():
    grid = response_grid([[-1.0, -2.0, -3.0], [-0.5, -0.25, -0.75, -0.125]], batch())
    assert grid.tolist() == [[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.25, -0.75, -0.125]]  # exact in float32
    with pytest.raises(ValueError, match="row 1: 3 values for 4 response tokens"):
        response_grid([[-1.0, -2.0, -3.0], [-0.5, -0.6, -0.7]], batch())


def test_the_run_is_refused_before_anything_starts(tiny_assets, tmp_path):
    """The preflight (`--dry-run` and every run, before Ray starts) refuses a teacher whose tokenizer
    is not the student's, naming both paths."""
    from megarl.config import load_and_validate
    from megarl.data.tiny_model import make_tiny_model
    from megarl.trainer.preflight import check_environment

    teacher = make_tiny_model("qwen2", tmp_path / "teacher", seed=1)
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(["<tool>"])
    tokenizer.save_pretrained(teacher)
    repo = Path(__file__).resolve().parents[2]
    config = load_and_validate(str(repo / "configs/tiny/opd.yaml"), [
        f"actor_rollout_ref.model.path={tiny_assets / 'model'}", f"distillation.teacher.model_path={teacher}",
        f"data.train_files={tiny_assets / 'data/train.parquet'}", f"data.val_files={tiny_assets / 'data/val.parquet'}"])
    with pytest.raises(ConfigError) as info:
        check_environment(config, "rl")
    assert f"distillation.teacher.model_path='{teacher}'" in str(info.value)
    assert f"'{tiny_assets / 'model'}'" in str(info.value)
