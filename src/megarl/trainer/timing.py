"""`Timer`: the wall-clock seconds of one step's phases, logged as `timing/<phase>_s`."""
from __future__ import annotations

import time
from contextlib import contextmanager


class Timer:
    """Wall-clock seconds per phase of one step (`timing/<phase>_s`); a phase timed twice adds up."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing/{phase}_s": s for phase, s in self.seconds.items()}
