"""A tiny OpenEnv environment, served by openenv's own create_app (configs/tiny/agent_openenv.yaml and
tests/envs/test_openenv.py): reset(seed) asks for a word (no spaces: the tiny tokenizer has none); each step
scores the guess (1 for the word, else half the share of its characters in place) and ends the episode on an
exact guess or after two guesses. A reset with seed 13 makes an environment whose step raises (one that fails
mid-episode). With OPENENV_GUESS_RECORD set, each step appends {episode, seed, guess, reward} to that jsonl file.

    python examples/envs/openenv_guess.py outputs/tiny/openenv     # writes train.parquet and val.parquet
"""
import json
import os
import sys
import uuid

from openenv.core.env_server import Action, Environment, Observation, State, create_app

WORDS = ["ab", "cab", "bead", "face"]
FAILING_SEED = 13
MAX_GUESSES = 2


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str


def guess_reward(guess: str, word: str) -> float:
    """1.0 for the word itself; otherwise the share of the word's positions the guess matches, halved."""
    guess = guess.strip()
    if guess == word:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(guess, word)) / len(word)


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.word, self.failing = WORDS[0], False

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.word, self.failing = WORDS[(seed or 0) % len(WORDS)], seed == FAILING_SEED
        self.seed, self.episode = seed, uuid.uuid4().hex
        return GuessObservation(prompt=f"spell:{self.word}?", reward=None, done=False)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if self.failing:
            raise RuntimeError("the guess environment broke")
        self._state.step_count += 1
        reward = guess_reward(action.message, self.word)
        done = reward == 1.0 or self._state.step_count >= MAX_GUESSES
        if os.environ.get("OPENENV_GUESS_RECORD"):
            with open(os.environ["OPENENV_GUESS_RECORD"], "a") as f:
                f.write(json.dumps({"episode": self.episode, "seed": self.seed, "guess": action.message,
                                    "reward": reward}) + "\n")
        return GuessObservation(prompt="again:", reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=32)


def write_dataset(out: str, train_size: int = 64, val_size: int = 8) -> None:
    """verl parquet rows (train: seeds 0.., val: seeds 1000..): one user message, the reset's seed in
    extra_info.openenv.reset (what megarl.agents.openenv_env passes to reset)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out, exist_ok=True)
    for name, seeds in (("train", range(train_size)), ("val", range(1000, 1000 + val_size))):
        rows = [{"prompt": [{"role": "user", "content": "go"}], "data_source": "openenv/guess",
                 "reward_model": {"ground_truth": ""}, "extra_info": {"openenv": {"reset": {"seed": s}}}}
                for s in seeds]
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(out, f"{name}.parquet"))


if __name__ == "__main__":
    write_dataset(sys.argv[1])
