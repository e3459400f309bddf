"""Evaluation results as figures (PNG): per-class accuracy, confusion, eigen-spectra, similarities, and runs side
by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from cloob_core.config import SUITE_RESULT
from cloob_core.evaluation.tables import COLUMNS, as_percent, datasets_in
from cloob_core.plots import save_png


def comparison_png(path: Path, runs: dict[str, dict[str, dict]]) -> str:
    """Grouped bars per run: the suite's aggregates where the runs have them, else zero-shot and linear-probe
    top-1 of each run's first data set."""
    labels = list(runs)
    names = list(dict.fromkeys(name for combined in runs.values() for name in combined.get(SUITE_RESULT, {})))
    if names:
        series = {f"{SUITE_RESULT}.{name}": [runs[label].get(SUITE_RESULT, {}).get(name) for label in labels]
                  for name in names}
        title = "suite means per run"
    else:
        first = {label: (datasets_in(combined) or [""])[0] for label, combined in runs.items()}
        series = {title: [runs[label].get(f"{first[label]}_{kind}", {}).get(key) for label in labels]
                  for kind, key, title in COLUMNS[:2]}
        title = f"runs side by side ({first[labels[0]]})" if labels else "no runs"
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(labels) + 2), 3.6))
    width = 0.8 / max(len(series), 1)
    for offset, (name, values) in enumerate(series.items()):
        shown = [100 * v if v is not None and as_percent(name) else (v or 0.0) for v in values]
        bars = ax.bar([i + (offset - (len(series) - 1) / 2) * width for i in range(len(labels))], shown, width=width,
                      label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("% (accuracies and recalls)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    return save_png(fig, path).name


def per_class_png(path: Path, classnames: Sequence[str], accuracy: Sequence[float], chance: float, title: str) -> str:
    width = max(6.0, min(0.25 * len(classnames), 30.0))
    fig, ax = plt.subplots(figsize=(width, 4))
    ax.bar(range(len(classnames)), [100 * a for a in accuracy], color="tab:green")
    if len(classnames) <= 60:
        ax.set_xticks(range(len(classnames)), list(classnames), rotation=90 if len(classnames) > 12 else 0)
    ax.axhline(100 * chance, color="gray", linestyle="--", label=f"chance {100 * chance:.1f}%")
    ax.set_ylim(0, 100)
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def confusion_png(path: Path, confusion: Sequence[Sequence[int]], classnames: Sequence[str], title: str) -> str:
    matrix = np.asarray(confusion, dtype=float)
    rows = matrix.sum(axis=1, keepdims=True)
    normalised = np.divide(matrix, rows, out=np.zeros_like(matrix), where=rows > 0)
    size = max(5.0, min(0.3 * len(classnames), 20.0))
    fig, ax = plt.subplots(figsize=(size + 1, size))
    image = ax.imshow(normalised, cmap="viridis", vmin=0, vmax=1)
    if len(classnames) <= 40:
        ax.set_xticks(range(len(classnames)), list(classnames), rotation=90)
        ax.set_yticks(range(len(classnames)), list(classnames))
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="share of the true class")
    return _save(fig, path)


def spectra_png(path: Path, spectra: dict[str, np.ndarray], effective: dict[str, int], title: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in spectra.items():
        values = np.asarray(values)
        ax.semilogy(np.arange(1, len(values) + 1), np.maximum(values / values.sum(), 1e-12),
                    label=f"{name} ({effective[name]} eigenvalues reach 99%)")
    ax.set_xlabel("eigenvalue rank")
    ax.set_ylabel("share of variance")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def similarity_png(path: Path, matched: np.ndarray, unmatched: np.ndarray, top_k: int, title: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    bins = np.linspace(min(matched.min(), unmatched.min()), max(matched.max(), unmatched.max()), 60)
    ax.hist(unmatched, bins=bins, alpha=0.6, density=True, label=f"top-{top_k} unmatched per image")
    ax.hist(matched, bins=bins, alpha=0.6, density=True, label="matched pairs")
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("density")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)
