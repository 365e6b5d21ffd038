"""Tracking writes real TensorBoard event files, a JSONL history, a summary and a PNG plot."""
import io
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.tracking import ConsoleLogger, Tracker


def test_tensorboard_jsonl_summary_and_plot(tmp_path):
    tracker = Tracker(["tensorboard"], "proj", "exp", log_dir=tmp_path, total_steps=3)
    for step in (1, 2, 3):
        tracker.log({"reward/mean": 0.1 * step, "actor/ppo_kl": 0.0, "val/score": None}, step=step)
    plot = tracker.finish()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("reward/mean")
    assert [e.step for e in rewards] == [1, 2, 3]
    assert [round(e.value, 6) for e in rewards] == [0.1, 0.2, 0.3]
    assert "val/score" not in events.Tags()["scalars"]  # None values are not logged

    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[2] == {"step": 3, "reward/mean": pytest.approx(0.3), "actor/ppo_kl": 0.0}
    summary = (tmp_path / "summary.txt").read_text()
    assert "reward/mean" in summary and "0.3" in summary
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_console_prints_one_plain_line_per_step_when_not_a_terminal():
    out = io.StringIO()
    console = ConsoleLogger(total_steps=10, stream=out)
    console.log({"reward/mean": 0.25, "timing/step_s": 1.5, "other/x": 3.0}, step=4)
    assert out.getvalue() == "step 4: reward/mean=0.25 timing/step_s=1.5\n"


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RuntimeError, match="wandb is not installed"):
        Tracker(["wandb"], "p", "e", log_dir=tmp_path)


def test_finish_without_steps_writes_no_plot(tmp_path):
    assert Tracker([], "p", "e", log_dir=tmp_path).finish() is None
