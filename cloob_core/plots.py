"""Figures people look at instead of reading numbers; written atomically as PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from cloob_core.io import atomic_write


def save_png(fig, path: str | Path, title: str | None = None) -> Path:
    """Lay out, write atomically, close."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)


def _draw_loss_and_lr(ax_loss, steps: Sequence[int], losses: Sequence[float], learning_rates: Sequence[float]) -> None:
    steps = list(steps)
    sparse = len(losses) < 50  # a few logged points: draw them plainly, no smoothing
    ax_loss.plot(steps, losses, color="tab:blue", linewidth=1.5 if sparse else 0.8, alpha=1.0 if sparse else 0.4,
                 label="loss", marker="." if sparse else None)
    window = max(1, len(losses) // 25)
    if not sparse and len(losses) >= window > 1:
        smooth = [
            sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
            for i in range(len(losses))
        ]
        ax_loss.plot(steps, smooth, color="tab:blue", linewidth=1.8, label=f"loss ({window}-point mean)")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_lr = ax_loss.twinx()
    ax_lr.plot(steps, learning_rates, color="tab:orange", linewidth=1.0, label="learning rate")
    ax_lr.set_ylabel("learning rate")
    handles = ax_loss.get_legend_handles_labels()[0] + ax_lr.get_legend_handles_labels()[0]
    ax_loss.legend(handles=handles, loc="upper right", fontsize=8)
    ax_loss.set_title("training")


def training_curves_png(path: str | Path, steps: Sequence[int], losses: Sequence[float],
                        learning_rates: Sequence[float], title: str) -> Path:
    """Loss and learning rate over the steps of a training run."""
    fig, ax = plt.subplots(figsize=(8, 4))
    _draw_loss_and_lr(ax, steps, losses, learning_rates)
    return save_png(fig, path, title)

