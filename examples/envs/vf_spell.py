"""A tiny verifiers environment, id `vf-spell` (configs/tiny/agent_verifiers.yaml, tests/envs/test_verifiers.py):
each row asks for a word (`spell:<word>?`, no spaces: the tiny tokenizer has none) and the rubric scores the
last answer: 1 for the word, else half the share of its characters in place. `turns=1` is verifiers'
SingleTurnEnv; `turns=2` a MultiTurnEnv that answers a wrong guess with `again:` and stops at the word or after
two guesses. A row whose info has `broken` makes the environment raise in its reply (mid-episode). With
VF_SPELL_RECORD set, each scored episode appends {answer, replies (the assistant messages' texts)} to that jsonl file.

verifiers finds an environment by id as the module `vf_spell` (verifiers.load_environment): install it as a
package, or name this folder as VerifiersConnector(env_dir=...).
"""
import json
import os

import verifiers as vf
from datasets import Dataset

WORDS = ["ab", "cab", "bead", "face"]


def spell_reward(guess: str, word: str) -> float:
    """1.0 for the word itself; otherwise the share of the word's positions the guess matches, halved."""
    guess = guess.strip()
    if guess == word:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(guess, word)) / len(word)


def spelled(completion, answer, parser, **kwargs) -> float:
    """The rubric's reward function: the last answer's spell_reward."""
    if os.environ.get("VF_SPELL_RECORD"):
        replies = [m["content"] if isinstance(m, dict) else m.content
                   for m in parser.get_assistant_messages(completion)]
        with open(os.environ["VF_SPELL_RECORD"], "a") as f:
            f.write(json.dumps({"answer": answer, "replies": replies}) + "\n")
    return spell_reward(parser.parse_answer(completion) or "", answer)


class SpellEnv(vf.MultiTurnEnv):
    @vf.stop
    async def word_spelled(self, state) -> bool:
        trajectory = state["trajectory"]
        last = (self.parser.parse_answer(trajectory[-1]["completion"]) or "").strip() if trajectory else None
        return last == state["answer"]

    async def env_response(self, messages, state, **kwargs):
        if state["info"].get("broken"):
            raise RuntimeError("the spell environment broke")
        return [{"role": "user", "content": "again:"}]


def rows(size: int, broken: tuple[int, ...] = ()) -> list[dict]:
    return [{"question": f"spell:{WORDS[i % len(WORDS)]}?", "answer": WORDS[i % len(WORDS)],
             "info": {"broken": i in broken}} for i in range(size)]


def load_environment(turns: int = 1, size: int = 8, eval_size: int = 4, broken: list[int] = ()) -> vf.Environment:
    """`size` training rows (words in turn), `eval_size` evaluation rows; the rows in `broken` raise mid-episode."""
    rubric = vf.Rubric(funcs=[spelled])
    dataset, eval_dataset = Dataset.from_list(rows(size, tuple(broken))), Dataset.from_list(rows(eval_size))
    if turns == 1:
        return vf.SingleTurnEnv(dataset=dataset, eval_dataset=eval_dataset, rubric=rubric)
    return SpellEnv(max_turns=turns, dataset=dataset, eval_dataset=eval_dataset, rubric=rubric)
