"""Stopping on request: SIGTERM (what Slurm and the launchers send) or SIGUSR1 (Slurm's warning
before the time limit) asks the run to checkpoint and stop; SIGINT (Ctrl-C) stops it at once.

The first SIGTERM or SIGUSR1 sets a flag the loop reads between steps: the current step finishes,
a checkpoint is written, and the run exits with PREEMPTED_EXIT_CODE (75, EX_TEMPFAIL: "try
again"), which the Slurm launcher takes as "requeue me". A second one, or any SIGINT, abandons the
step at once, wherever the driver waits (it waits in short slices: megarl.placement.worker_group),
and the run exits with 128 + the signal's number, as a shell reports a process its signal ended
(130 for Ctrl-C); the last complete checkpoint stands. Either way the run's teardown then stops
every process it started, with further stop signals held until it is done (`signals_held`).
"""
from __future__ import annotations

import logging
import signal
import threading
from contextlib import contextmanager
from typing import Optional

log = logging.getLogger("megarl.trainer")

PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # SIGINT: Ctrl-C


class Preempted(Exception):
    """The run stopped on a signal; `checkpoint` is the directory written on the way out (None
    when the step was abandoned)."""

    @property
    def exit_code(self) -> int:
        """75 when a checkpoint was written on the way out, else 128 + the signal's number."""
        return PREEMPTED_EXIT_CODE if self.checkpoint else 128 + self.signum

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
        if self.signum is not None or signum == signal.SIGINT:
            self.signum = self.signum or signum
            raise Preempted(signum, self.step, None)
        self.signum = signum
        log.warning("%s received: finishing this step, then checkpointing and stopping (send it again to stop "
                    "at once)", signal.Signals(signum).name)


@contextmanager
def signals_held(what: str):
    """Stop signals (and Ctrl-C) during `what`, the run's teardown, are logged and otherwise
    ignored (main thread only; elsewhere it does nothing): the teardown stops every process the
    run started, by PID and within its own bounds, and one interrupted half-way would leave some
    running. The previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame) -> None:
        log.warning("%s received while %s; it goes on (it stops every process of the run, within seconds)",
                    signal.Signals(signum).name, what)

    previous = {s: signal.signal(s, note) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
