"""How a run that stopped on a failure says so.

The console gets one line per failing rank (role, rank, node, cause), each once, and a resume hint
only when a complete checkpoint exists to resume from; the whole text with every remote traceback
goes to <run>/logs/failure.txt, which the console names.
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

from megarl.checkpoint import complete_checkpoints
from megarl.config import ConfigError
from megarl.trainer.preemption import Preempted

ITEM = "  - "
INTERRUPTED = ("megarl: interrupted (Ctrl-C); the interruption saved nothing (an RL run checkpoints on Ctrl-C "
               "once its training loop has started)")  # WorkerGroupError and the other run errors list one failure per line with this prefix


def console_lines(message: str) -> list[str]:
    """The message's headline and the first line of each listed failure, duplicates once; the
    detail lines under an item (remote tracebacks) are left for the failure file."""
    lines = message.splitlines() or [""]
    kept = [lines[0]]
    items = [line for line in lines[1:] if line.startswith(ITEM)]
    for line in items if items else lines[1:2]:
        if line not in kept:
            kept.append(line)
    return kept


def resume_hint(run_dir: Path) -> str:
    """What the next run does: continue from the last complete checkpoint, or start over."""
    found = complete_checkpoints(run_dir)
    if not found:
        return "no checkpoint was written yet (trainer.save_freq), so a new run starts from step 0"
    step, path = found[-1]
    return f"with trainer.resume_mode=auto the next run continues from step {step} ({path})"


def report_failure(error: BaseException, run_dir: Path) -> str:
    """Write the full failure to <run_dir>/logs/failure.txt; return the lines for the console."""
    full = "".join(traceback.format_exception(error))
    logs = Path(run_dir) / "logs"
    where = logs / "failure.txt"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        where.write_text(full)
        details = f"details (remote tracebacks): {where}"
    except OSError as problem:  # an unwritable run directory: the console gets all of it
        details = f"(cannot write {where}: {problem})\n{full}"
    lines = console_lines(f"{type(error).__name__}: {error}")
    lines[0] = f"megarl: the run stopped: {lines[0]}"
    return "\n".join([*lines, f"megarl: {details}", f"megarl: {resume_hint(Path(run_dir))}"])


def run_and_report(run, config) -> int:
    """Exit status of `run(config)`: 0; 75 after a stop signal that let the run checkpoint (a first
    SIGTERM or SIGUSR1); 128 + N after signal N stopped it at once (a second one, or Ctrl-C: 130,
    also before the training loop started); 1 after a failure, reported in a few
    lines (megarl.trainer.failures)."""
    t = config.trainer
    try:
        run(config)
    except Preempted as stopped:
        run_dir = Path(t.default_local_dir) / t.project_name / t.experiment_name
        hint = "resume with trainer.resume_mode=auto" if stopped.checkpoint else resume_hint(run_dir)
        print(f"megarl: {stopped}; exit status {stopped.exit_code} ({hint})", file=sys.stderr)
        return stopped.exit_code
    except KeyboardInterrupt:  # before the training loop installed its handler
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except ConfigError:
        raise  # one message, exit status 2 (entry_point)
    except Exception as error:  # noqa: BLE001 - every failure gets the same short report and its file
        print(report_failure(error, Path(t.default_local_dir) / t.project_name / t.experiment_name), file=sys.stderr)
        return 1
    return 0
