"""The results of a grid as the paper shows them: a table of the final figures (mean ± std over seeds) and the
figures that follow the embeddings over training: Fig. 2 (relative change of the effective eigenvalues against the
reference point), Fig. A1 (sorted eigenvalue spectra), Fig. 3 (uniformity) with InfoNCE saturation p1, and the
convergence of the headline metrics. Each figure states its data, steps and seeds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cloob_core.io import write_json, write_text
from cloob_core.plots import plt, save_png


@dataclass(frozen=True)
class GridReport:
    table: Path  # the Markdown table
    figures: list[Path]
    summary: Path  # summary.json: per cell, each final figure's mean, std and seeds


def _by_cell(results: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    cells: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        cells.setdefault(result["cell"], []).append(result)
    return cells


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _keys(results: Sequence[dict[str, Any]], suffix: str) -> list[str]:
    final = results[0]["trajectory"][-1]
    return sorted(key for key in final if key.endswith(suffix))


def columns(results: Sequence[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(key of a trajectory point or of the result, column title, shown as a percentage)."""
    zeroshot = [(key, f"{key.split('.')[0]} zero-shot top-1", True) for key in _keys(results, ".zeroshot_acc1")]
    recall = [(key, f"{key.split('.')[0]} {'image→text' if 'text_retrieval' in key else 'text→image'} "
               f"R@{key[-1]}", True) for key in _keys(results, "recall@1") + _keys(results, "recall@5")]
    diagnostics = [(key, f"{key.split('.')[0]} {title}", False) for suffix, title in (
        ("effective_eigenvalues_image", "eff. eigenvalues (image)"), ("effective_eigenvalues_text",
                                                                        "eff. eigenvalues (text)"),
        ("ajne_image", "Ajne A_n (image)"), ("ajne_text", "Ajne A_n (text)"),
        ("positive_probability_p1", "InfoNCE p1")) for key in _keys(results, suffix)]
    return [*zeroshot, *recall, *diagnostics, ("seconds_per_step", "s / step", False)]


def _value(result: dict[str, Any], key: str) -> float:
    return float(result[key] if key in result else result["trajectory"][-1][key])


def summary(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per cell, each column's mean, std and the seeds it covers."""
    out = {}
    for cell, runs in _by_cell(results).items():
        out[cell] = {key: dict(zip(("mean", "std"), _mean_std([_value(r, key) for r in runs]), strict=True))
                     | {"seeds": sorted(r["seed"] for r in runs)} for key, _, _ in columns(results)}
    return out


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    """Cells as rows, final figures as columns, mean ± std over seeds; the best mean of each column in bold."""
    cols, table = columns(results), summary(results)
    best = {key: max(table, key=lambda cell: table[cell][key]["mean"]) for key, _, _ in cols
            if key != "seconds_per_step" and "eigenvalues" not in key and "ajne" not in key and "p1" not in key}

    def cell_text(cell: str, key: str, percent: bool) -> str:
        mean, std = table[cell][key]["mean"], table[cell][key]["std"]
        if percent:
            text = f"{100 * mean:.1f} ± {100 * std:.1f}"
        else:
            text = f"{mean:.1f} ± {std:.1f}" if "eigenvalues" in key else f"{mean:.3f} ± {std:.3f}"
        return f"**{text}**" if best.get(key) == cell and len(table) > 1 else text

    lines = ["| cell | seeds | " + " | ".join(title for _, title, _ in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for cell in table:
        seeds = table[cell][cols[0][0]]["seeds"]
        lines.append(f"| {cell} | {len(seeds)} | " + " | ".join(cell_text(cell, key, pct) for key, _, pct in cols)
                     + " |")
    return "\n".join(lines) + "\n"


def _curves(runs: list[dict[str, Any]], key: str, relative: bool = False) -> tuple[np.ndarray, np.ndarray,
                                                                                    np.ndarray]:
    """Steps, mean and std over seeds of ``key`` along training (relative to each run's reference step)."""
    series = []
    for run in runs:
        values = {point["step"]: float(point[key]) for point in run["trajectory"]}
        if relative:
            reference = values[run["reference_step"]] or 1.0
            values = {step: value / reference - 1.0 for step, value in values.items()}
        series.append(values)
    steps = sorted(set.intersection(*(set(s) for s in series)))
    stacked = np.array([[s[step] for step in steps] for s in series])
    return np.array(steps), stacked.mean(axis=0), stacked.std(axis=0, ddof=1) if len(series) > 1 else 0 * stacked[0]


def _panel(axis, cells: dict[str, list[dict[str, Any]]], key: str, title: str, relative: bool = False,
           percent: bool = False) -> None:
    for cell, runs in cells.items():
        steps, mean, std = _curves(runs, key, relative)
        scale = 100 if percent else 1
        axis.plot(steps, scale * mean, marker="o", markersize=3, label=cell)
        axis.fill_between(steps, scale * (mean - std), scale * (mean + std), alpha=0.2)
    if relative:
        axis.axhline(0, color="grey", linewidth=0.8)
    axis.set_title(title, fontsize=9)
    axis.set_xlabel("step")
    axis.grid(alpha=0.3)


def _caption(results: Sequence[dict[str, Any]], data: str) -> str:
    steps = sorted({r["steps"] for r in results})
    seeds = sorted({r["seed"] for r in results})
    return (f"{results[0]['grid']} grid on {data}; {'/'.join(map(str, steps))} steps; seeds "
            f"{', '.join(map(str, seeds))} (mean ± std over seeds)")


def figures(results: Sequence[dict[str, Any]], output: Path, data: str) -> list[Path]:
    """The grid's figures in ``output``: eigenvalues (Fig. 2), spectra (Fig. A1), uniformity and p1 (Fig. 3),
    convergence."""
    cells, caption, written = _by_cell(results), _caption(results, data), []
    diag_sets = sorted({key.split(".")[0] for key in _keys(results, ".effective_eigenvalues_image")})

    def save(fig, name: str) -> None:
        fig.suptitle(caption, fontsize=9)
        written.append(save_png(fig, output / name))

    for name in diag_sets:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        reference = "reference: the checkpoint before the first LR restart"
        for axis, modality in zip(axes, ("image", "text"), strict=True):
            _panel(axis, cells, f"{name}.effective_eigenvalues_{modality}",
                   f"{name}: relative change of effective eigenvalues ({modality})\n{reference}", relative=True)
        axes[0].legend(fontsize=8)
        save(fig, f"{name}_eigenvalues_relative_change.png")

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for axis, modality in zip(axes, ("image", "text"), strict=True):
            for cell, runs in cells.items():
                spectra = np.array([run["trajectory"][-1][f"{name}.spectrum_{modality}"] for run in runs])
                spectra = spectra / spectra.sum(axis=1, keepdims=True)
                axis.semilogy(np.arange(1, spectra.shape[1] + 1), spectra.mean(axis=0), label=cell)
            axis.set_title(f"{name}: sorted eigenvalues of the {modality} embeddings (share of the sum), end of "
                           "training", fontsize=9)
            axis.set_xlabel("index")
            axis.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        save(fig, f"{name}_spectra.png")

        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for axis, key, title in zip(axes, ("ajne_image", "ajne_text", "positive_probability_p1"),
                                    ("Ajne A_n, image (lower: more uniform)", "Ajne A_n, text (lower: more uniform)",
                                     "InfoNCE saturation p1"), strict=True):
            _panel(axis, cells, f"{name}.{key}", f"{name}: {title}")
        axes[0].legend(fontsize=8)
        save(fig, f"{name}_uniformity_p1.png")

    headline = _keys(results, ".zeroshot_acc1") + _keys(results, "recall@5")
    if headline:
        fig, axes = plt.subplots(1, len(headline), figsize=(3.6 * len(headline), 3.6), squeeze=False)
        for axis, key in zip(axes[0], headline, strict=True):
            data, _, metric = key.partition(".")
            title = {"zeroshot_acc1": "zero-shot top-1", "image_retrieval_recall@5": "text→image R@5",
                     "text_retrieval_recall@5": "image→text R@5"}[metric]
            _panel(axis, cells, key, f"{data}: {title} (%)", percent=True)
        axes[0][0].legend(fontsize=8)
        save(fig, "convergence.png")
    return written


def grid_report(results: Sequence[dict[str, Any]], output: str | Path, data: str) -> GridReport:
    """``output/table.md``, ``summary.json`` and the figures; runs that diverged are listed under the table."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    measured = [result for result in results if result["trajectory"]]
    diverged = "".join(f"\n- {r['cell']}, seed {r['seed']}: diverged ({r['diverged']})" for r in results
                       if not r["trajectory"])
    text = f"{_caption(measured, data)}\n\n{markdown_table(measured)}" if measured else "no run finished\n"
    table = write_text(output / "table.md", text + (f"\nNot in the table:{diverged}\n" if diverged else ""))
    summary_file = write_json(output / "summary.json", summary(measured) if measured else {})
    return GridReport(table, figures(measured, output, data) if measured else [], summary_file)
