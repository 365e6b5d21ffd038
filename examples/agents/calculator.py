"""A two-turn tool-using episode on megarl's synthetic addition task ("23+45=" -> "68").

Turn 1: the model answers. If it is wrong, a calculator tool checks the answer and replies with
a hint (the first digit of the true sum, as "?6"), then repeats the question; turn 2: the model
answers again. Reward: 1 for a right first answer, 0.5 for a right second answer, else 0.
`success` (a right final answer) is reported as `agent/success/mean`.

The tool's reply and the repeated question are tokens the user's code adds: they are in the
trajectory with loss mask 0; only the model's two answers are trained.

    actor_rollout_ref.rollout.agent.path=examples/agents/calculator.py   (configs/tiny/agent_calculator.yaml)
"""
from megarl.rewards.synthetic import strip_response


def calculator_hint(ground_truth: str) -> str:
    """The tool's reply to a wrong answer: "?" and the first digit of the true sum."""
    return "?" + str(ground_truth)[0]


async def run_episode(client, sample) -> dict:
    messages = list(sample.messages)  # one user message, e.g. "23+45="
    truth = str(sample.ground_truth).strip()
    first = await client.chat.completions.create(model=sample.model, messages=messages, max_tokens=4)
    answer = strip_response(first.choices[0].message.content or "")
    if answer == truth:
        return {"score": 1.0, "success": 1.0, "turns": 1}
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "tool", "content": calculator_hint(truth) + messages[0]["content"]},
    ]
    second = await client.chat.completions.create(model=sample.model, messages=messages, max_tokens=4)
    right = strip_response(second.choices[0].message.content or "") == truth
    return {"score": 0.5 if right else 0.0, "success": float(right), "turns": 2}
