"""OpenEnv environments as agent episodes (megarl.agents.openenv_env): the environment examples/envs/openenv_guess.py,
served by openenv's own create_app in a server the connector starts on 127.0.0.1, plays episodes against megarl's
endpoint. Oracles: the environment itself, run in this process without megarl (the same guesses, its own rewards),
hand-known rewards of known-good and known-bad guesses, and what the policy sampled (token ids, log-probs). The
2-step GRPO run (the tiny model on CPU) checks the rewards the run records against the environment's own."""
import json
import os
import sys
from pathlib import Path

import pytest

from megarl.agents.openai_api import SamplingDefaults
from megarl.agents.openenv_env import SUPPORTED, OpenEnvConnector
from megarl.agents.runner import AgentRunner
from megarl.config.errors import ConfigError
from megarl.data.parquet import PromptRow
from megarl.data.prompts import Prompt, render_chats
from megarl.rewards.dispatch import default_compute_score
from megarl.rollout.client import Sample

from agent_batches import generated_runs, reply_text

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "examples" / "envs"  # the environment's folder (the server's --app-dir)
APP = "openenv_guess:app"
sys.path.insert(0, str(HERE))  # the environment, imported here as its server imports it
from openenv_guess import WORDS


@pytest.fixture(scope="module")
def connector(tmp_path_factory):
    env = OpenEnvConnector(APP, app_dir=str(HERE), log_path=str(tmp_path_factory.mktemp("openenv") / "server.log"))
    pid = env.server.pid
    yield env
    env.stop()
    with pytest.raises(ProcessLookupError):  # stopped by its PID
        os.kill(pid, 0)


def prompts_for(tokenizer, rows):
    """Prompts of (user message, reset seed) rows."""
    out = []
    for i, (content, seed) in enumerate(rows):
        row = PromptRow([{"role": "user", "content": content}], "openenv/guess", {}, extra_info={"openenv": {"reset": {"seed": seed}}})
        out.append(Prompt(i, render_chats(tokenizer, [row.messages])[0], row))
    return out


def environment_score(seed: int, guesses: list[str]) -> tuple[float, bool]:
    """The environment's own episode, without megarl: reset(seed), one step per guess; (sum of rewards, done)."""
    from openenv_guess import GuessAction, GuessEnvironment

    env = GuessEnvironment()
    env.reset(seed=seed)
    total, done = 0.0, False
    for guess in guesses:
        observation = env.step(GuessAction(message=guess))
        total, done = total + observation.reward, observation.done
    return total, done


class ScriptedPolicy:
    """The endpoint's `generate`: answers by the row's instruction, read from the prompt text: `good` spells the
    word at once, `late` after one wrong guess ("ca"), `bad` never ("ca" twice). Each answer is its tokens and <eos>."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    async def __call__(self, prompt_ids, sampling):
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        word = text.split("spell:")[1].split("?")[0]
        right = text.startswith("good") or (text.startswith("late") and text.endswith("again:"))
        answer = word if right else "ca"
        ids = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        self.calls.append((list(prompt_ids), ids))
        return Sample(ids, [-0.5] * len(ids), "stop", self.tokenizer.eos_token_id, answer, None)


def test_known_good_and_bad_answers_and_a_failing_environment(connector, tokenizer, caplog):
    """Known guesses through the whole path: megarl's scores equal the environment's own and the hand-known
    rewards; each row's generated runs are the policy's samples for the tokens before them, the environment's
    observations between them; an environment that raises mid-episode fails that episode only, named, and the
    batch keeps the rest."""
    rows = [("good", 1), ("late", 2), ("bad", 3), ("good", 13), ("bad", 0)]
    policy = ScriptedPolicy(tokenizer)
    runner = AgentRunner(connector.run_episode, policy, tokenizer, SamplingDefaults(max_new_tokens=8),
                         default_compute_score, n=1)
    runner.start()
    try:
        batch, metrics = runner.generate_and_score(prompts_for(tokenizer, rows), uid_prefix="s0")
    finally:
        runner.close()
    assert metrics["agent/episodes"] == 5 and metrics["agent/failed_episodes"] == 1, metrics
    assert batch.meta["agent_status"] == ["ok", "ok", "ok", "failed", "ok"]
    # by hand: "ca" on "face" has its "a" in place, 0.5 * 1/4 a guess; on "bead" and "ab" nothing
    expected = {0: (1.0, ["cab"]), 1: (1.0, ["ca", "bead"]), 2: (0.25, ["ca", "ca"]), 4: (0.0, ["ca", "ca"])}
    for row, (hand, guesses) in expected.items():
        score, done = environment_score(rows[row][1], guesses)
        assert done and score == hand and batch["scores"][row].item() == pytest.approx(score)
    assert batch["scores"].tolist() == pytest.approx([1.0, 1.0, 0.25, 0.0, 0.0])
    assert batch.meta["env_steps"] == [1, 2, 2, None, 2]
    sampled = {tuple(prompt): ids for prompt, ids in policy.calls}
    for row, (_, guesses) in expected.items():
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        ids, runs = generated_runs(batch, row)
        assert [run for _, run, _ in runs] == [sampled[tuple(prompt + ids[:start])] for start, _, _ in runs]
        assert [reply_text(tokenizer, run) for _, run, _ in runs] == guesses
        assert all(logprobs == [-0.5] * len(run) for _, run, logprobs in runs)
        observations = tokenizer.decode(prompt, skip_special_tokens=True)
        assert observations == f"{rows[row][0]}spell:{WORDS[rows[row][1] % 4]}?"  # the reset's observation
        between = tokenizer.decode([t for t, m in zip(ids, batch["response_mask"][row].tolist()) if not m],
                                   skip_special_tokens=True)
        assert between == "again:" * (len(guesses) - 1)  # each step's observation, not trained on
    assert "OpenEnv environment 'openenv_guess:app' failed at step 1: RuntimeError" in caplog.text
    assert "the guess environment broke" in caplog.text


@pytest.mark.parametrize("app,message", [
    ("openenv_gues:app", "no module 'openenv_gues' in this Python.*pip install <its package>"),
    ("openenv_guess", "give the server's app as 'package.module:app'"),
    ("openenv_guess:no_app", 'did not start.*Attribute "no_app" not found.*Fix: openenv_guess must import'),
])
def test_an_unknown_environment_is_told_with_its_name_and_the_fix(app, message):
    with pytest.raises(ConfigError, match=f"(?s)OpenEnv environment '{app}'.*{message}"):
        OpenEnvConnector(app, app_dir=str(HERE), startup_timeout_s=30)


def test_the_supported_range_is_setup_pys(supported_range_is_setup_pys):
    supported_range_is_setup_pys("openenv", SUPPORTED)


@pytest.mark.parametrize("version,message", [(None, "openenv is not installed"), ("0.11.0", "openenv 0.11.0 is installed")])
def test_a_missing_or_unsupported_library_is_told_with_the_fix(installed_version, version, message):
    installed_version("openenv", version)
    with pytest.raises(ConfigError, match=f"{message}.*pip install 'megarl\\[envs\\]'"):
        OpenEnvConnector(APP, app_dir=str(HERE))


@pytest.mark.slow
def test_grpo_on_an_openenv_environment_records_its_rewards(tmp_path, monkeypatch):
    """2 GRPO steps of the tiny model through configs/tiny/agent_openenv.yaml (4 seeds x 2 episodes a step, no
    validation): the environment's server logs every guess it was sent; each step's reward/mean is the mean,
    over its 8 episodes, of the rewards the environment gives those guesses when run here without megarl."""
    from openenv_guess import write_dataset

    from megarl.data.tiny_model import make_tiny_model
    from megarl.testing import run_to_completion

    tiny_dir = make_tiny_model("qwen2", tmp_path / "model", seed=0)

    write_dataset(str(tmp_path / "data"), train_size=8, val_size=1)
    record = tmp_path / "steps.jsonl"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/agent_openenv.yaml"),
           f"actor_rollout_ref.model.path={tiny_dir}", f"data.train_files={tmp_path / 'data/train.parquet'}",
           f"data.val_files={tmp_path / 'data/val.parquet'}", f"trainer.default_local_dir={tmp_path / 'out'}",
           f"actor_rollout_ref.rollout.agent.path={REPO / 'examples/agents/openenv_guess.py'}",
           "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[console]"]
    monkeypatch.setenv("OPENENV_GUESS_RECORD", str(record))  # the trainer, its driver and so the server inherit it
    run_to_completion(cmd, tmp_path, 300, "GRPO on openenv/guess")
    episodes: dict[str, list] = {}  # in the order the server saw them: step 1's 8, then step 2's
    for line in record.read_text().splitlines():
        step = json.loads(line)
        episodes.setdefault(step["episode"], []).append(step)
    assert len(episodes) == 16
    scores = []
    for steps in episodes.values():
        score, done = environment_score(steps[0]["seed"], [s["guess"] for s in steps])
        assert done and score == pytest.approx(sum(s["reward"] for s in steps))
        scores.append(score)
    metrics = [json.loads(line) for line in
               (tmp_path / "out/megarl-tiny/agent_openenv/logs/metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "timing/step_s" in m]
    assert [m["reward/mean"] for m in steps] == pytest.approx([sum(scores[:8]) / 8, sum(scores[8:]) / 8])
    assert all(m["agent/failed_episodes"] == 0 for m in steps)
