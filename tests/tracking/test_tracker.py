"""Tracking writes real TensorBoard event files, a JSONL history, a summary and a PNG plot."""
import io
import json

import pytest
from matplotlib.figure import Figure
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megarl.tracking import ConsoleLogger, Tracker
from megarl.tracking.plot import is_sparse


@pytest.fixture
def saved_figures(monkeypatch):
    """(figure, dpi) of every matplotlib figure saved during the test (still written to its file)."""
    saved = []
    real_savefig = Figure.savefig

    def savefig(fig, *args, **kwargs):
        saved.append((fig, kwargs.get("dpi") or fig.dpi))
        return real_savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_tensorboard_jsonl_and_summary(tmp_path):
    tracker = Tracker(["tensorboard"], "proj", "exp", log_dir=tmp_path, total_steps=3)
    for step in (1, 2, 3):
        tracker.log({"reward/mean": 0.1 * step, "actor/ppo_kl": 0.0, "val/score": None}, step=step)
    tracker.finish()

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


def tensorboard_smoothing(values, weight=0.8):
    """TensorBoard's 'Smoothing' (its default 0.8), written out: a debiased EMA whose first point is
    the first value."""
    last, num_accum, out = 0.0, 0, []
    for value in values:
        last = last * weight + (1 - weight) * value
        num_accum += 1
        out.append(last / (1 - weight**num_accum))
    return out


def test_sft_and_dpo_runs_plot_their_own_metrics(tmp_path, saved_figures):
    """Issue 26 item 8: SFT's plot was five empty RL panels."""
    sft = Tracker([], "proj", "sft-run", log_dir=tmp_path / "sft")
    for step in (1, 2, 3):
        sft.log({"sft/nll": 2.0 / step, "sft/grad_norm": 1.0, "sft/lr": 1e-4, "timing/step_s": 0.1}, step=step)
    sft.log({"val/nll": 1.0}, step=3)
    sft.finish()
    dpo = Tracker([], "proj", "dpo-run", log_dir=tmp_path / "dpo")
    dpo.log({"dpo/loss": 0.69, "dpo/reward_margin": 0.0, "dpo/reward_accuracy": 0.5}, step=1)
    dpo.finish()
    (sft_figure, _), (dpo_figure, _) = saved_figures
    assert [ax.get_title() for ax in sft_figure.axes] == ["NLL (train, nats/token)", "NLL (validation, nats/token)",
                                                          "gradient norm", "learning rate"]
    assert all(ax.get_lines() for ax in sft_figure.axes)  # every panel drawn
    assert list(sft_figure.axes[0].get_lines()[0].get_ydata()) == pytest.approx([2.0, 1.0, 2 / 3])
    assert sft_figure._suptitle.get_text() == "proj/sft-run"
    assert [ax.get_title() for ax in dpo_figure.axes][0] == "DPO loss (train)"
    assert dpo_figure._suptitle.get_text() == "proj/dpo-run"


def test_the_plot_draws_the_logged_series(tmp_path, saved_figures):
    """The curves in the saved figure are the values TensorBoard recorded, panel by panel: a dense
    series raw and smoothed, a sparse one (logged at only some steps) as measured."""
    import matplotlib.image

    tracker = Tracker(["tensorboard"], "proj", "exp", log_dir=tmp_path, total_steps=4)
    logged = {1: {"reward/mean": 0.5, "actor/ppo_kl": 0.0, "response_length/mean": 12.0},
              2: {"reward/mean": 0.25, "actor/ppo_kl": 0.01, "response_length/mean": 10.0, "val/score": 0.4},
              3: {"reward/mean": 0.75, "actor/ppo_kl": 0.02, "response_length/mean": 9.0},
              4: {"reward/mean": 1.0, "actor/ppo_kl": 0.005, "response_length/mean": 8.0, "val/score": 0.6}}
    for step, metrics in logged.items():
        tracker.log(metrics, step=step)
    plot = tracker.finish()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    recorded = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert sorted(recorded) == ["actor/ppo_kl", "response_length/mean", "reward/mean", "val/score"]

    [(figure, dpi)] = saved_figures
    panels = {ax.get_title(): ax for ax in figure.axes}
    metric_of_panel = {"reward (train, mean)": "reward/mean", "validation score": "val/score", "ppo_kl": "actor/ppo_kl",
                       "response length (tokens)": "response_length/mean", "entropy (nats/token)": None}
    assert panels.keys() == metric_of_panel.keys()
    for title, metric in metric_of_panel.items():
        lines = panels[title].get_lines()
        if metric is None:  # never logged: an empty panel
            assert lines == []
            continue
        steps, values = zip(*recorded[metric])
        if metric == "val/score":  # sparse: one line through the measured values
            [measured] = lines
            assert list(measured.get_xdata()) == list(steps) and list(measured.get_ydata()) == pytest.approx(values)
            continue
        raw, smooth = lines  # the per-step values and a smoothed line over them
        assert list(raw.get_xdata()) == list(steps) == list(smooth.get_xdata()), title
        assert list(raw.get_ydata()) == pytest.approx(values, abs=1e-6), title  # TensorBoard stores float32
        assert list(smooth.get_ydata()) == pytest.approx(tensorboard_smoothing(values), abs=1e-6), title
    assert figure._suptitle.get_text() == "proj/exp"  # the run
    width, height = (figure.get_size_inches() * dpi).round().astype(int)
    assert matplotlib.image.imread(plot).shape[:2] == (height, width)  # the file holds this figure


@pytest.mark.parametrize("series_steps, history_steps, sparse", [
    ({1, 2, 3}, {1, 2, 3}, False),                 # a training metric, every step
    ({1, 2, 3}, {0, 1, 2, 3}, False),              # the same with a validation before training (step 0)
    ({0, 1, 2, 3}, {0, 1, 2, 3}, False),           # validation every step (test_freq 1)
    ({101, 102}, {101, 102}, False),               # a resumed run's history starts after its checkpoint
    ({0, 2, 4, 5}, {0, 1, 2, 3, 4, 5}, True),      # validation every test_freq=2 steps and at the last
    ({0}, {0, 1, 2}, True),                        # only before training
    ({1, 3}, {1, 2, 3}, True),                     # missing at a training step
])
def test_a_series_is_sparse_when_a_training_step_lacks_it(series_steps, history_steps, sparse):
    assert is_sparse(series_steps, history_steps) is sparse


def test_a_sparse_series_is_plotted_as_measured_and_a_dense_one_smoothed(tmp_path, saved_figures):
    """Issue 50: with few validation points the smoothed line ended at 0.57 where the run scored
    0.613. The validation score's line must end at the last score logged."""
    tracker = Tracker([], "proj", "exp", log_dir=tmp_path, total_steps=4)
    logged = {0: {"val/score": 0.25},  # validation before training, then every test_freq=2 steps
              1: {"reward/mean": 0.0},
              2: {"reward/mean": 1.0, "val/score": 0.5},
              3: {"reward/mean": 1.0},
              4: {"reward/mean": 1.0, "val/score": 0.613}}
    for step, metrics in logged.items():
        tracker.log(metrics, step=step)
    tracker.finish()
    [(figure, _)] = saved_figures
    panels = {ax.get_title(): ax for ax in figure.axes}

    [measured] = panels["validation score"].get_lines()
    assert list(measured.get_xdata()) == [0, 2, 4]
    assert list(measured.get_ydata()) == [0.25, 0.5, 0.613]  # exactly as logged: it ends at 0.613

    raw, smooth = panels["reward (train, mean)"].get_lines()
    assert list(raw.get_ydata()) == [0.0, 1.0, 1.0, 1.0]
    # TensorBoard's EMA (weight 0.8) by hand: running r_t = 0.8 r_{t-1} + 0.2 x_t, shown r_t / (1 - 0.8^t):
    # r = 0, 0.2, 0.36, 0.488 over 1 - 0.8^t = 0.2, 0.36, 0.488, 0.5904 -> 0, 5/9, 45/61, 305/369
    assert list(smooth.get_ydata()) == pytest.approx([0.0, 5 / 9, 45 / 61, 305 / 369])


def test_console_prints_one_plain_line_per_step_with_progress_and_eta_when_not_a_terminal():
    """Off a terminal (a Slurm log) each line says how far the run is and how long is left."""
    out, now = io.StringIO(), [1000.0]
    console = ConsoleLogger(total_steps=10, stream=out, clock=lambda: now[0])
    now[0] += 30.0  # validation before training
    console.log({"val/score": 0.5}, step=0)
    now[0] += 120.0  # steps 1-4 took 2 minutes in all, with the validation: 150 s for 4 steps
    console.log({"reward/mean": 0.25, "timing/step_s": 1.5, "other/x": 3.0}, step=4)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 0/10 (0%), elapsed 0:00:30: val/score=0.5"
    # ETA: 150 s / 4 steps x 6 steps left = 225 s
    assert lines[1] == "step 4/10 (40%), elapsed 0:02:30, ETA 0:03:45: reward/mean=0.25 timing/step_s=1.5"


def test_a_resumed_run_counts_its_rate_from_the_step_it_resumed_at():
    out, now = io.StringIO(), [0.0]
    console = ConsoleLogger(total_steps=200, stream=out, clock=lambda: now[0])
    now[0] = 10.0
    console.log({"reward/mean": 1.0}, step=101)  # resumed after step 100
    now[0] = 20.0
    console.log({"reward/mean": 1.0}, step=102)
    assert out.getvalue().splitlines()[1] == "step 102/200 (51%), elapsed 0:00:20, ETA 0:16:20: reward/mean=1"


def test_the_end_of_run_summary_is_short_and_the_full_table_is_in_a_file(tmp_path):
    tracker = Tracker([], "p", "e", log_dir=tmp_path)
    for step in (1, 2):
        tracker.log({"reward/mean": 0.1 * step, **{f"perf/m{i}": float(i) for i in range(80)}}, step=step)
    tracker.finish()
    short = tracker.summary().splitlines()
    assert len(short) == 3 and short[1].startswith("reward/mean") and "0.2" in short[1]
    assert short[2] == f"all 81 metrics: {tmp_path / 'summary.txt'}"
    assert len((tmp_path / "summary.txt").read_text().splitlines()) == 82


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
