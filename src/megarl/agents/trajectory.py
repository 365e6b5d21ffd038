"""One episode's model calls -> one training row, from the recorded token ids (never re-tokenised).

    prompt    = the first call's prompt ids
    response  = every token after it, in order:
                the tokens each call sampled          loss mask 1, their rollout log-probs
                the tokens the user's code added      loss mask 0, log-prob 0
                between calls (tool outputs, user turns, the chat template's glue)

Call k+1 must extend call k token for token: its prompt starts with call k's prompt followed by
call k's sampled ids. The endpoint returns replies with their special tokens kept as text (only
the final stop token dropped) so that a chat quoting them back re-renders to the sampled ids.
Where it still does not (the user edited or dropped history, a stop string was cut from the reply,
or the tokenizer merges the reply's text differently), the episode is refused with
`PrefixMismatchError` and the runner counts it (`agent/failed/prefix_mismatch`) as a failed
episode. megarl never trains on a row whose tokens differ from what the policy saw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megarl.agents.records import CallRecord


@dataclass(frozen=True)
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # per response token: 1 = sampled by the policy, 0 = added by the user's code
    rollout_log_probs: list[float]  # per response token: the rollout's log-prob, 0.0 where loss_mask is 0
    num_calls: int
    finish_reason: str  # of the last call

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)


class PrefixMismatchError(ValueError):
    """A call whose prompt does not extend the previous call's prompt + sampled ids."""


def assemble_trajectory(calls: Sequence[CallRecord]) -> Trajectory:
    """The row of an episode whose calls are `calls`, in the order they were made (at least one)."""
    if not calls:
        raise ValueError("an episode without model calls has no trajectory")
    first = calls[0]
    response: list[int] = list(first.output_ids)
    mask = [1] * len(first.output_ids)
    logprobs = list(_checked_logprobs(first, 0))
    context = list(first.prompt_ids) + list(first.output_ids)
    for k, call in enumerate(calls[1:], start=1):
        prompt = list(call.prompt_ids)
        if prompt[: len(context)] != context:
            at = next((i for i, (a, b) in enumerate(zip(prompt, context)) if a != b), min(len(prompt), len(context)))
            raise PrefixMismatchError(
                f"call {k}'s prompt ({len(prompt)} tokens) does not extend call {k - 1}'s prompt + completion "
                f"({len(context)} tokens): first difference at token {at} "
                f"(prompt {prompt[at:at + 8]} vs recorded {context[at:at + 8]})"
            )
        added = prompt[len(context):]
        response += added + list(call.output_ids)
        mask += [0] * len(added) + [1] * len(call.output_ids)
        logprobs += [0.0] * len(added) + _checked_logprobs(call, k)
        context = prompt + list(call.output_ids)
    return Trajectory(list(first.prompt_ids), response, mask, logprobs, len(calls), calls[-1].finish_reason)


def _checked_logprobs(call: CallRecord, k: int) -> list[float]:
    if len(call.logprobs) != len(call.output_ids):
        raise ValueError(f"call {k} has {len(call.output_ids)} sampled ids but {len(call.logprobs)} log-probs")
    return list(call.logprobs)
