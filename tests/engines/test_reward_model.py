"""The reward model on the megatron engine (CPU, gloo) against HF `AutoModelForSequenceClassification`
in fp32, and its start-up checks."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_world import ragged_batch
from reward_model_world import RM_LAYOUTS, reward_model_world, rm_config
from transformers import AutoModelForSequenceClassification

from megarl.bridge import ConversionError
from megarl.testing import run_gloo_workers
from megarl.engines.megatron.reward_model import check_score_head, check_tokenizer
from megarl.engines.megatron.sequences import make_micro_batch

REPO = Path(__file__).resolve().parents[2]
BATCH = 10


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny qwen2 reward model made by tools/make_tiny_model.py --reward-model."""
    out = tmp_path_factory.mktemp("rm") / "rm"
    made = subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--reward-model", "--out", str(out),
                           "--layers", "2", "--hidden", "64", "--seed", "3"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return out


def hf_scores(rm_dir, batch) -> torch.Tensor:
    """HF's score of each prompt + response, without padding."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    scores = []
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        with torch.no_grad():
            scores.append(model(torch.cat([prompt, response])[None]).logits[0, 0])
    return torch.stack(scores)


@pytest.mark.slow  # one 2-rank megatron world, three layouts: ~40 s on 2 cores
def test_rm_scores_equal_hf_sequence_classification_scores(reward_model):
    results = run_gloo_workers(reward_model_world, 2, args=(str(reward_model), BATCH), timeout_s=400)
    expected = hf_scores(reward_model, ragged_batch(BATCH, seed=3))
    assert expected.std() > 0.01  # the responses score differently: an index off by one would show
    for layout in RM_LAYOUTS:
        parts = {dp: s for r in results for (lay, dp), s in r.items() if lay == layout}
        dp_size = 2 // (layout[0] * layout[1])
        assert sorted(parts) == list(range(dp_size)), layout
        got = torch.cat([parts[dp] for dp in range(dp_size)])
        assert got.dtype == torch.float32 and got.shape == (BATCH,)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"TP{layout[0]} PP{layout[1]}")


@pytest.mark.parametrize("layout, multiple, cp", [("padded", 1, 1), ("packed", 1, 1), ("packed", 4, 2)])
def test_hidden_rows_pick_each_samples_last_real_token(layout, multiple, cp):
    batch = ragged_batch(5, seed=1)
    rows = [0, 2, 3, 4]
    mb = make_micro_batch(batch, rows, layout, vocab_size=47, device=torch.device("cpu"), multiple=multiple)
    if cp > 1:  # the whole packed sequence: every CP rank's rows, put back in place
        parts = [make_micro_batch(batch, rows, layout, 47, torch.device("cpu"), multiple=multiple, cp=cp, cp_rank=r)
                 for r in range(cp)]
        mb = parts[0]
        flat_ids = torch.zeros(sum(p.input_ids.numel() for p in parts), dtype=torch.long)
        for r, part in enumerate(parts):
            flat_ids[mb.cp_rows[r]] = part.input_ids.reshape(-1)
    else:
        flat_ids = mb.input_ids.t().reshape(-1) if layout == "padded" else mb.input_ids.reshape(-1)  # hidden's row order
    index = mb.hidden_rows(batch.token_lengths()[rows] - 1)
    last = [batch["response_ids"][r][batch["response_mask"][r].bool()][-1] for r in rows]
    assert flat_ids[index].tolist() == torch.stack(last).tolist()


def test_a_checkpoint_without_a_score_head_is_refused_naming_it(reward_model, tmp_path):
    from megarl.data.tiny_model import make_tiny_model

    lm = make_tiny_model("qwen2", tmp_path / "lm", layers=1, hidden=32, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match=rf"needs a `score.weight` of shape \[1, 32\] in {lm}, which has none"):
        check_score_head(str(lm))
    check_score_head(str(reward_model))  # the real one passes


def test_num_labels_other_than_one_is_refused_naming_the_file(reward_model, tmp_path):
    rm = tmp_path / "rm3"
    shutil.copytree(reward_model, rm)
    config = json.loads((rm / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b", "2": "c"}
    (rm / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=rf"{rm / 'config.json'}.*num_labels=3; a reward model needs num_labels=1"):
        check_score_head(str(rm))


def test_another_tokenizer_is_a_clear_not_implemented_error(reward_model, tmp_path):
    check_tokenizer(rm_config(reward_model, 2, 1, 1))  # the same tokenizer: fine
    other = rm_config(reward_model, 2, 1, 1)
    other.reward_model.model.input_tokenizer = str(tmp_path)
    with pytest.raises(NotImplementedError, match="input_tokenizer=.*differs from the policy's tokenizer.*re-tokenising"):
        check_tokenizer(other)
    shutil.copytree(reward_model, tmp_path / "rm")
    vocab = json.loads((tmp_path / "rm" / "tokenizer.json").read_text())
    vocab["model"]["vocab"]["zz"] = len(vocab["model"]["vocab"])
    (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(vocab))
    changed = rm_config(tmp_path / "rm", 2, 1, 1)
    changed.actor_rollout_ref.model.path = str(reward_model)
    with pytest.raises(NotImplementedError, match="tokenizer's vocabulary differs from the policy's"):
        check_tokenizer(changed)
