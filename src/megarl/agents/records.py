"""What the endpoint records: every model call of a trajectory, token-in/token-out.

A trajectory is opened by the runner before its episode starts, receives one `CallRecord` per
model call (in the order the calls were answered) and is closed when the episode ends. The
per-episode limits are enforced here, before a call reaches the rollout servers:

    max_turns               model calls per trajectory
    max_tokens_per_episode  prompt + generated tokens of a call may not exceed it; a call's
                            `max_new_tokens` is cut to what is left

A call beyond a limit raises `EpisodeLimitError` (the endpoint answers HTTP 400) and the
trajectory remembers which limit was hit. A trajectory may carry its own sampling (validation
episodes sample with `rollout.val_kwargs`); the endpoint samples its calls with it.
Thread-safe: the endpoint and the runner live on different threads.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from megarl.agents.openai_api import SamplingDefaults


@dataclass(frozen=True)
class CallRecord:
    """One model call: the exact prompt ids sent, the sampled ids and their log-probs."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # logprobs[t] is the rollout log-prob of output_ids[t]
    finish_reason: str  # "stop" | "length" | "abort"


@dataclass
class TrajectoryLog:
    calls: list[CallRecord] = field(default_factory=list)
    turns_started: int = 0
    limit_hit: Optional[str] = None  # "max_turns" | "max_tokens_per_episode", once a call was refused
    sampling: Optional[SamplingDefaults] = None  # None: the endpoint's own


class EpisodeLimitError(Exception):
    """A call refused because its trajectory reached a limit; `limit` names the config key."""

    def __init__(self, limit: str, message: str):
        self.limit = limit
        super().__init__(message)


class UnknownTrajectoryError(KeyError):
    """A call tagged with a trajectory id that is not open."""


class TrajectoryRecorder:
    def __init__(self, max_turns: Optional[int] = None, max_tokens_per_episode: Optional[int] = None):
        self.max_turns = max_turns
        self.max_tokens_per_episode = max_tokens_per_episode
        self._open: dict[str, TrajectoryLog] = {}
        self._lock = threading.Lock()

    def open(self, trajectory_id: str, sampling: Optional[SamplingDefaults] = None) -> None:
        """Start recording `trajectory_id`, whose calls sample with `sampling` (None: the endpoint's)."""
        with self._lock:
            if trajectory_id in self._open:
                raise ValueError(f"trajectory {trajectory_id!r} is already open")
            self._open[trajectory_id] = TrajectoryLog(sampling=sampling)

    def close(self, trajectory_id: str) -> TrajectoryLog:
        """Stop recording `trajectory_id`; later calls with its id are refused."""
        with self._lock:
            return self._open.pop(trajectory_id)

    def is_open(self, trajectory_id: str) -> bool:
        with self._lock:
            return trajectory_id in self._open

    def sampling(self, trajectory_id) -> Optional[SamplingDefaults]:
        """The sampling `trajectory_id` was opened with; None if it has none or is not open."""
        with self._lock:
            log = self._open.get(trajectory_id)
            return None if log is None else log.sampling

    def begin_call(self, trajectory_id: str, prompt_tokens: int, max_new_tokens: int) -> int:
        """Count one more turn and return the `max_new_tokens` the limits allow (>= 1), or raise
        `EpisodeLimitError` (recorded on the trajectory)."""
        with self._lock:
            log = self._open.get(trajectory_id)
            if log is None:
                raise UnknownTrajectoryError(trajectory_id)
            if self.max_turns is not None and log.turns_started >= self.max_turns:
                log.limit_hit = "max_turns"
                raise EpisodeLimitError("max_turns", f"trajectory {trajectory_id!r} used its {self.max_turns} turns "
                                                     "(actor_rollout_ref.rollout.agent.max_turns)")
            if self.max_tokens_per_episode is not None:
                left = self.max_tokens_per_episode - prompt_tokens
                if left < 1:
                    log.limit_hit = "max_tokens_per_episode"
                    raise EpisodeLimitError(
                        "max_tokens_per_episode",
                        f"trajectory {trajectory_id!r}: the prompt has {prompt_tokens} tokens, leaving none of "
                        f"{self.max_tokens_per_episode} (actor_rollout_ref.rollout.agent.max_tokens_per_episode)")
                max_new_tokens = min(max_new_tokens, left)
            log.turns_started += 1
            return max_new_tokens

    def add(self, trajectory_id: str, call: CallRecord) -> None:
        """Record an answered call (dropped silently if the trajectory was closed meanwhile, e.g.
        after its episode timed out)."""
        with self._lock:
            log = self._open.get(trajectory_id)
            if log is not None:
                log.calls.append(call)
