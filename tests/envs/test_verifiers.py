"""verifiers environments as agent episodes (megarl.agents.verifiers_env): the environment examples/envs/vf_spell.py
(id `vf-spell`), loaded by verifiers' own load_environment, runs its own rollout against megarl's endpoint and is
scored by its own rubric. Oracles: the environment's rubric run here without megarl on the same completions
(verifiers' score_rollout), hand-known rewards of known-good, partly right and failing answers, and what the
policy sampled (token ids, log-probs). The 2-step GRPO run (the tiny model on CPU) checks the rewards the run
records against the rubric's own on the completions the run sampled."""
import asyncio
import json
import sys
from pathlib import Path

import pytest

from megarl.agents.openai_api import SamplingDefaults
from megarl.agents.runner import AgentRunner
from megarl.agents.verifiers_env import SUPPORTED, VerifiersConnector
from megarl.config.errors import ConfigError
from megarl.data.parquet import PromptRow
from megarl.data.prompts import Prompt, render_chats
from megarl.rewards.dispatch import default_compute_score
from megarl.rollout.client import Sample

from agent_batches import generated_runs, reply_text

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "examples" / "envs"  # the environment's folder (VerifiersConnector's env_dir)
ENV_ID = "vf-spell"
BROKEN = 3  # the row whose environment raises in its reply: "face"


def prompts_of(tokenizer, rows: list[dict]) -> list[Prompt]:
    out = []
    for i, row in enumerate(rows):
        prompt_row = PromptRow(row["prompt"], row["data_source"], row["reward_model"], extra_info=row["extra_info"])
        out.append(Prompt(i, render_chats(tokenizer, [prompt_row.messages])[0], prompt_row))
    return out


def rubric_score(connector: VerifiersConnector, row: dict, replies: list[str]) -> float:
    """The environment's own rubric (verifiers' score_rollout), without megarl, on a rollout state of `row` whose
    completion is `replies` with the environment's `again:` between them."""
    import openai
    from verifiers.clients import OpenAIChatCompletionsClient

    rollout_input = {**json.loads(row["extra_info"]["verifiers"]["input"]), "prompt": row["prompt"]}
    unused = OpenAIChatCompletionsClient(openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="none"))

    async def score() -> float:
        state = await connector.env.init_state(rollout_input, unused, "policy")
        completion = []
        for k, reply in enumerate(replies):
            completion += [{"role": "assistant", "content": reply}] + ([{"role": "user", "content": "again:"}]
                                                                        if k < len(replies) - 1 else [])
        state["completion"] = completion
        state["trajectory"] = [{"completion": [{"role": "assistant", "content": r}]} for r in replies]
        await connector.env.rubric.score_rollout(state)
        return state["reward"]

    return asyncio.run(score())


class ScriptedPolicy:
    """The endpoint's `generate`, by the word the prompt asks for: "ab" spelled at once; "cab" after one guess
    short of its last letter ("ca"); any other word never (its first letters, twice). Each answer: its tokens, <eos>."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    async def __call__(self, prompt_ids, sampling):
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        word = text.split("spell:")[1].split("?")[0]
        right = word == "ab" or (word == "cab" and text.endswith("again:"))
        answer = word if right else word[:-1]
        ids = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        self.calls.append((list(prompt_ids), ids))
        return Sample(ids, [-0.5] * len(ids), "stop", self.tokenizer.eos_token_id, answer, None)


# by hand (spell_reward): the word 1.0; its first letters 0.5 * (len - 1) / len
EXPECTED = {1: {0: (1.0, ["ab"]), 1: (1 / 3, ["ca"]), 2: (0.375, ["bea"]), 3: (0.375, ["fac"])},
            2: {0: (1.0, ["ab"]), 1: (1.0, ["ca", "cab"]), 2: (0.375, ["bea", "bea"])}}


@pytest.mark.parametrize("turns", [1, 2])
def test_known_answers_score_as_the_rubric_and_the_tokens_are_the_samples(tokenizer, turns, caplog):
    """Known answers through verifiers' rollout and megarl's endpoint: megarl's scores equal the rubric's own on the
    same completions and the hand-known rewards; each row's generated runs are the policy's samples for the tokens
    before them, the environment's replies between them; with two turns an environment that raises mid-episode
    fails that episode only, named, and the batch keeps the rest."""
    connector = VerifiersConnector(ENV_ID, env_args={"turns": turns, "size": 4, "broken": [BROKEN]}, env_dir=str(HERE))
    rows = connector.rows("train")
    policy = ScriptedPolicy(tokenizer)
    runner = AgentRunner(connector.run_episode, policy, tokenizer, SamplingDefaults(max_new_tokens=8),
                         default_compute_score, n=1)
    runner.start()
    try:
        batch, metrics = runner.generate_and_score(prompts_of(tokenizer, rows), uid_prefix="s0")
    finally:
        runner.close()
    expected = EXPECTED[turns]
    assert metrics["agent/episodes"] == 4 and metrics["agent/failed_episodes"] == 4 - len(expected), metrics
    for row, (hand, replies) in expected.items():
        assert batch.meta["agent_status"][row] == "ok"
        assert rubric_score(connector, rows[row], replies) == pytest.approx(hand)
        assert batch["scores"][row].item() == pytest.approx(hand)
        assert batch.meta["env_turns"][row] == len(replies)
    sampled = {tuple(prompt): ids for prompt, ids in policy.calls}
    for row, (_, replies) in expected.items():
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        ids, runs = generated_runs(batch, row)
        assert [run for _, run, _ in runs] == [sampled[tuple(prompt + ids[:start])] for start, _, _ in runs]
        assert [reply_text(tokenizer, run) for _, run, _ in runs] == replies
        assert all(logprobs == [-0.5] * len(run) for _, run, logprobs in runs)
        between = tokenizer.decode([t for t, m in zip(ids, batch["response_mask"][row].tolist()) if not m],
                                   skip_special_tokens=True)
        assert between == "again:" * (len(replies) - 1)  # the environment's replies, not trained on
    if turns == 2:
        assert batch.meta["agent_status"][BROKEN] == "failed"
        assert "verifiers environment 'vf-spell' failed mid-episode: RuntimeError" in caplog.text
        assert "the spell environment broke" in caplog.text


def test_an_empty_reply_fails_its_episode_as_verifiers_refuses_it(tokenizer, caplog):
    """A reply of <eos> alone (no text) is an error to verifiers (EmptyModelResponseError ends its rollout): that
    episode fails, named, and scores 0; the others are scored by the rubric."""
    connector = VerifiersConnector(ENV_ID, env_args={"size": 2}, env_dir=str(HERE))
    policy = ScriptedPolicy(tokenizer)

    async def empty_for_cab(prompt_ids, sampling):
        if "spell:cab?" in tokenizer.decode(prompt_ids, skip_special_tokens=True):
            return Sample([tokenizer.eos_token_id], [-0.5], "stop", tokenizer.eos_token_id, "", None)
        return await policy(prompt_ids, sampling)

    runner = AgentRunner(connector.run_episode, empty_for_cab, tokenizer, SamplingDefaults(max_new_tokens=8),
                         default_compute_score, n=1)
    runner.start()
    try:
        batch, _ = runner.generate_and_score(prompts_of(tokenizer, connector.rows("train")), uid_prefix="s0")
    finally:
        runner.close()
    assert batch.meta["agent_status"] == ["ok", "failed"] and batch["scores"].tolist() == [1.0, 0.0]
    assert "verifiers environment 'vf-spell' failed mid-episode: EmptyModelResponseError" in caplog.text


def test_the_dataset_becomes_verl_rows(tmp_path):
    """write_dataset: the environment's dataset (train) and eval dataset (val), its prompts and answers."""
    import pyarrow.parquet as pq

    connector = VerifiersConnector(ENV_ID, env_args={"size": 5, "eval_size": 2}, env_dir=str(HERE))
    paths = connector.write_dataset(tmp_path)
    train, val = pq.read_table(paths["train"]).to_pylist(), pq.read_table(paths["val"]).to_pylist()
    dataset = connector.env.get_dataset()
    assert [r["prompt"] for r in train] == [[{"role": "user", "content": q}] for q in dataset["question"]]
    assert [r["reward_model"]["ground_truth"] for r in train] == dataset["answer"]
    assert len(val) == 2 and {r["data_source"] for r in train + val} == {"verifiers/vf-spell"}


@pytest.mark.parametrize("env_id,args,message", [
    ("vf-spel", {}, "no module 'vf_spel' in this Python.*pip install <its package>"),
    (ENV_ID, {"turn": 2}, "did not load with env_args {'turn': 2}: TypeError.*must define load_environment"),
])
def test_an_unknown_environment_is_told_with_its_name_and_the_fix(env_id, args, message):
    with pytest.raises(ConfigError, match=f"(?s)verifiers environment '{env_id}'.*{message}"):
        VerifiersConnector(env_id, env_args=args, env_dir=str(HERE))


def test_the_supported_range_is_setup_pys(supported_range_is_setup_pys):
    supported_range_is_setup_pys("verifiers", SUPPORTED)


@pytest.mark.parametrize("version,message", [(None, "verifiers is not installed"),
                                             ("0.4.0", "verifiers 0.4.0 is installed")])
def test_a_missing_or_unsupported_library_is_told_with_the_fix(installed_version, version, message):
    installed_version("verifiers", version)
    with pytest.raises(ConfigError, match=f"{message}.*pip install 'megarl\\[envs\\]'"):
        VerifiersConnector(ENV_ID, env_dir=str(HERE))


@pytest.mark.slow
def test_grpo_on_a_verifiers_environment_records_its_rubrics_rewards(tmp_path, monkeypatch):
    """2 GRPO steps of the tiny model through configs/tiny/agent_verifiers.yaml (4 rows x 2 episodes a step, no
    validation): the environment logs the replies of every episode it scored; each step's reward/mean is the mean,
    over its 8 episodes, of the rubric's own rewards for those replies, scored here without megarl (an episode the
    random model ends with an empty reply fails, as verifiers refuses it, and counts 0)."""
    from megarl.data.tiny_model import make_tiny_model
    from megarl.testing import run_to_completion

    tiny_dir = make_tiny_model("qwen2", tmp_path / "model", seed=0)
    connector = VerifiersConnector(ENV_ID, env_args={"turns": 2, "size": 8, "eval_size": 1}, env_dir=str(HERE))
    connector.write_dataset(tmp_path / "data")
    row_of = {row["reward_model"]["ground_truth"]: row for row in connector.rows("train")}
    record = tmp_path / "episodes.jsonl"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/agent_verifiers.yaml"),
           f"actor_rollout_ref.model.path={tiny_dir}", f"data.train_files={tmp_path / 'data/train.parquet'}",
           f"data.val_files={tmp_path / 'data/val.parquet'}", f"trainer.default_local_dir={tmp_path / 'out'}",
           f"actor_rollout_ref.rollout.agent.path={REPO / 'examples/agents/verifiers_spell.py'}",
           "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[console]"]
    monkeypatch.setenv("VF_SPELL_RECORD", str(record))  # the trainer and its driver inherit it
    run_to_completion(cmd, tmp_path, 300, "GRPO on verifiers/vf-spell")
    metrics = [json.loads(line) for line in
               (tmp_path / "out/megarl-tiny/agent_verifiers/logs/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "timing/step_s" in m]
    scored = [8 - int(m["agent/failed_episodes"]) for m in steps]  # the episodes the rubric scored, per step
    episodes = [json.loads(line) for line in record.read_text().splitlines()]  # step 1's, then step 2's
    assert len(steps) == 2 and len(episodes) == sum(scored) >= 12
    scores = [rubric_score(connector, row_of[e["answer"]], e["replies"]) for e in episodes]
    assert [m["reward/mean"] for m in steps] == pytest.approx([sum(scores[:scored[0]]) / 8,
                                                               sum(scores[scored[0]:]) / 8])
