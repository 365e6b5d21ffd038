"""Stopping on request: SIGTERM (what Slurm and the launchers send), SIGUSR1 (Slurm's warning
before the time limit) or SIGINT (Ctrl-C) asks the run to checkpoint and stop.

The first signal sets a flag the loop reads between steps: the current step finishes, a
checkpoint is written, and the run exits with PREEMPTED_EXIT_CODE (75, EX_TEMPFAIL: "try again"),
which the Slurm launcher takes as "requeue me". A second signal abandons the step at once (the last
checkpoint stands).
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

log = logging.getLogger("megarl.trainer")

PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # SIGINT: Ctrl-C


class Preempted(Exception):
    """The run stopped on a signal; `checkpoint` is the directory written on the way out (None
    when the step was abandoned)."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        saved = f"checkpoint {checkpoint}" if checkpoint else "no new checkpoint (the step was abandoned)"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}: {saved}")


class StopRequest:
    """Context manager: installs the handlers (main thread only; elsewhere it does nothing) and
    restores the previous ones on exit. `signum` is the first signal received, or None."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.step = 0  # the loop keeps this current, for the abandon message
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise Preempted(signum, self.step, None)
        self.signum = signum
        log.warning("%s received: finishing this step, then checkpointing and stopping (send it again to stop "
                    "at once)", signal.Signals(signum).name)
