"""GRPO with a reward model, end to end on CPU: the tiny policy, the tiny reward model
(tools/make_tiny_model.py --reward-model) on the megatron engine at DP2, CPU-engine rollout
servers, Ray placement on logical GPUs (configs/tiny/grpo_rm.yaml). The controller's methods are
driven directly, so the test sees the experience batch: the reward model's scores equal HF's,
become the score (alone, or plus the rule score) and reach the GRPO advantages.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from megarl.config import load_and_validate, load_config
from megarl.data.batch import Batch
from megarl.data.synthetic import write_task_dataset
from megarl.data.tiny_model import make_tiny_model
from megarl.trainer import experience
from megarl.runtime.cluster import Cluster, connect_ray
from megarl.trainer.rl import RLTrainer, Timer

REPO = Path(__file__).resolve().parents[2]

# the end-to-end tests share one Ray cluster (actor TP2, reward model DP2, two rollout servers): the
# layout grpo_rm.yaml had before configs/tiny moved to one logical GPU (issue 28), set here
LAYOUT = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
SLOW = pytest.mark.slow


def length_score(data_source, solution_str, ground_truth, extra_info):
    """A rule score that differs between responses (the tiny policy never solves the task)."""
    return len(solution_str) / 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_rm")
    make_tiny_model("qwen2", root / "model", seed=0)
    made = subprocess.run([sys.executable, str(REPO / "tools/make_tiny_model.py"), "--reward-model", "--out",
                           str(root / "reward_model"), "--seed", "7"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    write_task_dataset("add", root / "data", train_size=64, val_size=8, sft_size=0, seed=0)
    return root


def experiment(tiny: Path, *overrides: str):
    return load_and_validate(REPO / "configs/tiny/grpo_rm.yaml", [
        f"actor_rollout_ref.model.path={tiny / 'model'}", f"reward_model.model.path={tiny / 'reward_model'}",
        f"data.train_files={tiny / 'data/train.parquet'}", f"data.val_files={tiny / 'data/val.parquet'}",
        f"trainer.default_local_dir={tiny / 'out'}", "trainer.logger=[console]", *LAYOUT, *overrides])


@pytest.fixture(scope="module")
def cluster(tiny):
    config = experiment(tiny)
    started_ray = not ray.is_initialized()
    connect_ray(config)
    cl = Cluster(config)
    try:
        yield cl
    finally:
        cl.shutdown()
        if started_ray:
            ray.shutdown()


def hf_scores(rm_dir: Path, batch) -> torch.Tensor:
    """The HF reward model's score head at the last token of each prompt + response (no padding).
    That is its sequence-classification output, except for a response ending in the pad token
    (the random policy samples <pad>), where HF's pooling would skip the trailing pad tokens."""
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    scores = []
    for i in range(len(batch)):
        ids = torch.cat([batch["prompt_ids"][i][batch["prompt_mask"][i].bool()],
                         batch["response_ids"][i][batch["response_mask"][i].bool()]])[None]
        with torch.no_grad():
            scores.append(model.score(model.model(ids).last_hidden_state[0, -1])[0])
            if model.config.pad_token_id not in ids:
                torch.testing.assert_close(scores[-1], model(ids).logits[0, 0], rtol=1e-5, atol=1e-6)
    return torch.stack(scores)


def group_normalised(scores: torch.Tensor, uids: list) -> torch.Tensor:
    """GRPO's (s - group mean) / (group std (Bessel) + 1e-6), per response."""
    out = torch.empty_like(scores)
    for uid in set(uids):
        rows = torch.tensor([u == uid for u in uids])
        group = scores[rows]
        out[rows] = (group - group.mean()) / (group.std() + 1e-6)
    return out


@SLOW
def test_reward_model_scores_are_the_grpo_reward(tiny, cluster, monkeypatch):
    seen = []
    real = experience.rewards_and_advantages

    def capture(batch, *args, **kwargs):  # the batch the update trains on
        seen.append(batch)
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(experience, "rewards_and_advantages", capture)
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    metrics = RLTrainer(experiment(tiny), cluster, tokenizer, length_score).train_step()
    (batch,) = seen
    assert len(batch) == 32
    torch.testing.assert_close(batch["rm_scores"], hf_scores(tiny / "reward_model", batch), rtol=1e-5, atol=1e-5)
    assert batch["rm_scores"].std() > 0.01
    assert torch.equal(batch["scores"], batch["rm_scores"])  # the reward model alone
    mask = batch["response_mask"].float()
    expected = group_normalised(batch["rm_scores"], batch["uid"])[:, None] * mask
    torch.testing.assert_close(batch["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert metrics["reward/rm_score_mean"] == pytest.approx(batch["rm_scores"].mean().item())
    assert metrics["reward/mean"] == pytest.approx(batch["rm_scores"].mean().item())
    assert metrics["reward/rule_score_mean"] > 0 and metrics["actor/tokens"] > 0


@SLOW
def test_add_rule_reward_adds_the_rule_score(tiny, cluster):
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    config = experiment(tiny, "reward_model.add_rule_reward=true")
    trainer = RLTrainer(config, cluster, tokenizer, length_score)
    batch, metrics = trainer.generate_and_score(trainer.train_data.take(range(8)), Timer(), "t")
    texts = tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(batch["response_ids"], batch["response_mask"])])
    rule = torch.tensor([len(t) / 10 for t in texts])
    torch.testing.assert_close(batch["rule_scores"], rule)
    assert rule.std() > 0
    torch.testing.assert_close(batch["rm_scores"], hf_scores(tiny / "reward_model", batch), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch["scores"], batch["rm_scores"] + rule)
    experience.rewards_and_advantages(batch, config)
    expected = group_normalised(batch["rm_scores"] + rule, batch["uid"])[:, None] * batch["response_mask"].float()
    torch.testing.assert_close(batch["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert metrics["reward/rule_score_mean"] == pytest.approx(rule.mean().item())


@pytest.mark.parametrize("add_rule_reward", [False, True])
def test_combine_rm_scores_with_and_without_the_rule_score_and_overlong_penalty(add_rule_reward):
    config = load_config(None, [f"reward_model.add_rule_reward={add_rule_reward}", "reward_model.overlong_buffer_len=2",
                                "data.max_response_length=4"])
    batch = Batch.from_token_lists([[1, 5], [1, 6], [1, 7]], [[8, 2], [8, 9, 9, 2], [8, 9, 2]])
    penalty = torch.tensor([0.0, -1.0, -0.5])  # lengths 2, 4, 3 with 2 of 4 tokens as the buffer
    batch["scores"] = torch.tensor([1.0, 0.0, 1.0]) + penalty  # as `experience.score` leaves them
    metrics = experience.combine_rm_scores(batch, torch.tensor([0.5, 2.0, -1.0]), config)
    rule = torch.tensor([1.0, 0.0, 1.0]) if add_rule_reward else torch.zeros(3)
    expected = torch.tensor([0.5, 2.0, -1.0]) + rule + penalty
    torch.testing.assert_close(batch["scores"], expected)
    torch.testing.assert_close(batch["token_level_scores"].sum(-1), expected)
    assert batch["token_level_scores"][1, 3] == expected[1] and batch["token_level_scores"][0, 1] == expected[0]
    assert metrics["reward/rm_score_mean"] == pytest.approx(0.5) and metrics["reward/rm_score_max"] == 2.0
    with pytest.raises(ValueError, match=r"reward model scores have shape \[2\], expected \[3\]"):
        experience.combine_rm_scores(batch, torch.zeros(2), config)
