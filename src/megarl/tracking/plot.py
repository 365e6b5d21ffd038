"""The end-of-run PNG: reward, validation score, KL, entropy and response length over steps."""
from __future__ import annotations

from pathlib import Path

PANELS = (
    ("reward/mean", "reward (train, mean)"),
    ("val/score", "validation score"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/entropy", "entropy (nats/token)"),
    ("response_length/mean", "response length (tokens)"),
)


def plot_history(history: list[dict], path: Path) -> Path:
    """Draw one panel per metric of PANELS (a missing metric leaves its panel empty but titled)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (key, title) in zip(axes, PANELS):
        points = [(row["step"], row[key]) for row in history if key in row]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 20 else None, markersize=3)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
