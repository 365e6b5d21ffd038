"""Experiment tracking: console, TensorBoard and Weights & Biases behind one `Tracker`.

    tracker = Tracker(["console", "tensorboard"], "megarl", "exp1", log_dir="outputs/exp1", total_steps=300)
    tracker.log({"reward/mean": 0.4, "timing/step_s": 1.2}, step=1)
    tracker.finish()   # summary table + PNG plot of the run's curves (RL, SFT or DPO panels)

Metric names are `group/name`; values are floats. The console shows a live progress bar on a
terminal and otherwise one plain line per step with `step k/N`, elapsed time and ETA (CI logs,
sbatch output). The end-of-run summary is short; the full table goes to `summary.txt`.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from megarl.tracking.plot import plot_history

# Metrics shown on the console line, in this order, when present.
CONSOLE_KEYS = (
    "reward/mean", "val/score", "val/sampled_score", "sft/nll", "val/nll", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "critic/vf_loss",
    "response_length/mean", "dpo/loss", "dpo/reward_margin", "dpo/reward_accuracy", "val/dpo_loss",
    "val/dpo_reward_margin", "agent/success/mean", "agent/failed_episodes", "timing/step_s", "throughput/tokens_per_s",
)


def _fmt(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _clock(seconds: float) -> str:
    """H:MM:SS."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress(step: int, total: int | None, first_step: int, elapsed_s: float) -> str:
    """'step k/N (p%), elapsed H:MM:SS, ETA H:MM:SS' for a plain log line. The rate is that of the
    steps this process ran (first_step: the step it started after, e.g. a resumed checkpoint's)."""
    if not total:
        return f"step {step}, elapsed {_clock(elapsed_s)}"
    text = f"step {step}/{total} ({100 * step / total:.0f}%), elapsed {_clock(elapsed_s)}"
    done = step - first_step
    if done > 0 and step < total:
        text += f", ETA {_clock(elapsed_s / done * (total - step))}"
    return text


class ConsoleLogger:
    """A tqdm bar on a terminal; elsewhere (Slurm logs, CI) one line per step with the progress,
    elapsed time and ETA. `clock` returns seconds (monotonic)."""

    def __init__(self, total_steps: int | None, stream=None, clock=time.monotonic):
        self.stream = stream or sys.stdout
        self.total, self.clock, self.started = total_steps, clock, clock()
        self.first_step: int | None = None
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, unit="step", file=self.stream, dynamic_ncols=True)

    def log(self, metrics: dict, step: int) -> None:
        shown = {k: metrics[k] for k in CONSOLE_KEYS if k in metrics}
        if self.first_step is None:  # step 0 is the validation before training; else a resumed run's first step
            self.first_step = step if step == 0 else step - 1
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix({k.split("/")[-1]: _fmt(v) for k, v in shown.items()}, refresh=True)
        else:
            line = " ".join(f"{k}={_fmt(v)}" for k, v in shown.items())
            where = progress(step, self.total, self.first_step, self.clock() - self.started)
            print(f"{where}: {line}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class TensorBoardLogger:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict, step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, project: str, experiment: str, config: dict | None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("trainer.logger includes 'wandb' but wandb is not installed (pip install wandb)") from None
        self.run = wandb.init(project=project, name=experiment, config=config or {})

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """Fans metrics out to the configured loggers and keeps the history for the final plot.

    `log_dir` receives `tensorboard/` (event files), `metrics.jsonl` (one line per step, always
    written) and at the end `curves.png` and `summary.txt`.
    """

    def __init__(self, loggers: list[str], project: str, experiment: str, log_dir: str | Path,
                 total_steps: int | None = None, config: dict | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.title = f"{project}/{experiment}"
        self.history: list[dict] = []
        self.backends = []
        for name in loggers:
            if name == "console":
                self.backends.append(ConsoleLogger(total_steps))
            elif name == "tensorboard":
                self.backends.append(TensorBoardLogger(self.log_dir / "tensorboard"))
            elif name == "wandb":
                self.backends.append(WandbLogger(project, experiment, config))
            else:
                raise ValueError(f"trainer.logger: unknown logger {name!r}")
        self.jsonl = open(self.log_dir / "metrics.jsonl", "a")

    def log(self, metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        self.history.append({"step": step, **clean})
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        for backend in self.backends:
            backend.log(clean, step)

    def summary(self) -> str:
        """The end-of-run lines for the console: the headline metrics (CONSOLE_KEYS) and where the
        full table is."""
        table = self.full_summary(keys=[k for k in CONSOLE_KEYS if any(k in row for row in self.history)])
        return f"{table}\nall {self._metric_count()} metrics: {self.log_dir / 'summary.txt'}"

    def _metric_count(self) -> int:
        return len({k for row in self.history for k in row if k != "step"})

    def full_summary(self, keys: list[str] | None = None) -> str:
        """Last value, minimum and maximum of every metric (of `keys` when given)."""
        keys = sorted({k for row in self.history for k in row if k != "step"}) if keys is None else keys
        lines = [f"{'metric':<40} {'last':>12} {'min':>12} {'max':>12}"]
        for key in keys:
            values = [row[key] for row in self.history if key in row and math.isfinite(row[key])]
            if values:
                lines.append(f"{key:<40} {values[-1]:>12.5g} {min(values):>12.5g} {max(values):>12.5g}")
        return "\n".join(lines)

    def finish(self) -> Path | None:
        """Close the loggers; write summary.txt and curves.png. Returns the plot's path (None when
        nothing was logged)."""
        for backend in self.backends:
            backend.close()
        self.jsonl.close()
        if not self.history:
            return None
        (self.log_dir / "summary.txt").write_text(self.full_summary() + "\n")
        return plot_history(self.history, self.log_dir / "curves.png", title=self.title)
