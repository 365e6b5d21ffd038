"""The end-of-run PNG: one panel per headline metric of the trainer that ran (RL, SFT or DPO),
titled with the run. A dense series (logged at every training step) is drawn raw with a smoothed
line over it; a sparse one (e.g. `val/*`, logged every `test_freq` steps) as measured, its points
joined, so its last point is the last value logged."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

PANEL_SETS = {
    "rl": (
        ("reward/mean", "reward (train, mean)"),
        ("val/score", "validation score"),
        ("actor/ppo_kl", "ppo_kl"),
        ("actor/entropy", "entropy (nats/token)"),
        ("response_length/mean", "response length (tokens)"),
    ),
    "sft": (
        ("sft/nll", "NLL (train, nats/token)"),
        ("val/nll", "NLL (validation, nats/token)"),
        ("sft/grad_norm", "gradient norm"),
        ("sft/lr", "learning rate"),
    ),
    "dpo": (
        ("dpo/loss", "DPO loss (train)"),
        ("val/dpo_loss", "DPO loss (validation)"),
        ("dpo/reward_margin", "reward margin (train)"),
        ("dpo/reward_accuracy", "reward accuracy (train)"),
    ),
}
SMOOTHING = 0.8  # weight of the past in the exponential moving average (TensorBoard's slider, 0.8)


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average with TensorBoard's start-up correction (the first points are not
    pulled towards 0): s_t = (w s_{t-1} + (1 - w) x_t) / (1 - w^t), s_0 = 0."""
    out, running = [], 0.0
    for t, value in enumerate(values, start=1):
        running = weight * running + (1 - weight) * value
        out.append(running / (1 - weight**t))
    return out


def is_sparse(series_steps: set[int], history_steps: set[int]) -> bool:
    """Whether a series is sparse: some training step of the run (a step >= 1 in the history; step 0
    is the validation before training) lacks it. A sparse series is plotted as measured, unsmoothed;
    a dense one (logged at every training step, with or without step 0) is smoothed."""
    return not {s for s in history_steps if s >= 1} <= series_steps


def panels_for(history: list[dict]) -> tuple[tuple[str, str], ...]:
    """The panel set of the trainer whose metrics the history holds most of (RL on a tie)."""
    logged = {k for row in history for k in row}
    return max(PANEL_SETS.values(), key=lambda panels: sum(key in logged for key, _ in panels))


def plot_history(history: list[dict], path: Path, title: Optional[str] = None) -> Path:
    """Draw one panel per metric of the history's panel set (a missing metric leaves its panel
    empty but titled); the figure's title is `title` (the run)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    panels = panels_for(history)
    history_steps = {row["step"] for row in history}
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (key, name) in zip(axes, panels):
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            steps, values = zip(*points)
            if is_sparse(set(steps), history_steps):
                ax.plot(steps, values, marker="o", markersize=3, linewidth=2, label="as measured")
            else:
                raw = ax.plot(steps, values, marker="o" if len(points) < 20 else None, markersize=3, alpha=0.35,
                              linewidth=1, label="per step")[0]
                ax.plot(steps, smoothed(list(values)), color=raw.get_color(), linewidth=2,
                        label=f"smoothed (EMA {SMOOTHING:g})")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
