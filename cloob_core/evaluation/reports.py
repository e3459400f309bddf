"""Results in the formats their readers use: CLIP_benchmark's JSON per (model, data set, task), a combined
``metrics.json`` for DVC, PNG plots for people, and a Markdown page that links them."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from cloob_core import storage
from cloob_core.config import ConfigError
from cloob_core.io import atomic_write, read_json, read_json_or, write_json, write_text
from cloob_core.plots import save_png


def benchmark_record(dataset: str, model: str, pretrained: str, task: str, metrics: dict[str, Any]) -> dict:
    """CLIP_benchmark's result layout."""
    return {"dataset": dataset, "model": model, "pretrained": pretrained, "task": task, "metrics": metrics,
            "language": "en"}


def write_result(output: Path, record: dict, plots: Sequence[str] = ()) -> Path:
    """``<dataset>_<task>.json``, merged into ``metrics.json`` (scalars only), listed in ``report.md``."""
    name = f"{record['dataset']}_{record['task']}"
    write_json(output / f"{name}.json", record)
    combined = read_json_or(output / "metrics.json", {})
    combined[name] = {k: v for k, v in record["metrics"].items() if isinstance(v, int | float)}
    write_json(output / "metrics.json", combined)
    entries = read_json_or(output / ".report.json", {})
    entries[name] = {"record": f"{name}.json", "plots": list(plots), "model": record["model"],
                     "pretrained": record["pretrained"],
                     "scalars": combined[name]}
    write_json(output / ".report.json", entries)
    write_text(output / "report.md", _markdown(entries))
    return output / f"{name}.json"


@dataclass(frozen=True)
class Report:
    output: Path
    metrics: dict[str, dict]  # the scalars of each result (data set x task), as in OUTPUT/metrics.json


def combine_reports(inputs: Sequence[Path], output: Path) -> Report:
    """One report over several evaluation folders (the DVC pipeline runs each task into its own, since DVC outputs
    may not overlap): their scalars in ``OUTPUT/metrics.json``, their records in ``OUTPUT/results/``, their plots
    in ``OUTPUT/figures/`` (a folder DVC shows as image plots), and ``OUTPUT/report.md`` linking both."""
    storage.ensure_folder(output)
    entries: dict[str, dict] = {}
    for folder in inputs:
        found = read_json_or(folder / ".report.json", None)
        if not found:
            raise ConfigError(f"{folder} holds no evaluation results (no .report.json); run `cloob eval` into it "
                              "first")
        for name, entry in found.items():
            if name in entries:
                raise ConfigError(f"result {name} appears in two input folders")
            moved = {**entry, "record": f"results/{entry['record']}", "plots": [f"figures/{p}" for p in entry["plots"]]}
            for source, target in zip((entry["record"], *entry["plots"]), (moved["record"], *moved["plots"]),
                                      strict=True):
                atomic_write(output / target, lambda tmp, src=folder / source: shutil.copyfile(src, tmp))
            entries[name] = moved
    combined = {name: entry["scalars"] for name, entry in sorted(entries.items())}
    write_json(output / "metrics.json", combined)
    write_text(output / "report.md", _markdown(entries))
    return Report(output, combined)


HEADLINE = ("top1", "mean_per_class_recall", "lambda_", "image_to_text_R@1", "text_to_image_R@1",
            "effective_eigenvalues_image", "effective_eigenvalues_text", "positive_probability_p1")


def read_metrics(path: str | Path) -> dict[str, dict]:
    """A report's ``metrics.json`` (result name -> scalars)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; run the pipeline (dvc repro) or `cloob eval report` first")
    metrics = read_json(path)
    if not isinstance(metrics, dict) or not all(isinstance(v, dict) for v in metrics.values()):
        raise ConfigError(f"{path} is not a report's metrics.json (an object of results, each an object of "
                          "metrics)")
    return metrics


def summary_table(combined: dict[str, dict]) -> str:
    """The headline numbers of each result, one line each, for a terminal."""
    lines = ["evaluation summary"]
    width = max((len(name) for name in combined), default=0)
    for name, scalars in combined.items():
        shown = [(key, scalars[key]) for key in HEADLINE if key in scalars]
        cells = [f"{key} {100 * value:.2f}%" if key in ("top1", "mean_per_class_recall") or "R@" in key
                 else f"{key} {value:.4g}" for key, value in shown]
        lines.append(f"  {name:<{width}}  " + ", ".join(cells))
    return "\n".join(lines)


# (task suffix of a result name, scalar, column title): what a comparison of runs shows
COMPARED = (("zeroshot_classification", "top1", "zero-shot top-1"), ("linear_probe", "top1", "linear-probe top-1"),
            ("zeroshot_retrieval", "image_to_text_R@1", "image->text R@1"),
            ("zeroshot_retrieval", "text_to_image_R@1", "text->image R@1"),
            ("diagnostics", "effective_eigenvalues_image", "effective eigenvalues (image)"))


def _datasets(combined: dict[str, dict]) -> list[str]:
    """The data sets a report has results for (result names are ``<data set>_<task>``)."""
    tasks = {task for task, _, _ in COMPARED}
    return sorted({name[: -len(task) - 1] for name in combined for task in tasks if name.endswith(f"_{task}")})


def comparison_rows(runs: dict[str, dict[str, dict]]) -> tuple[list[str], list[list[str]], dict[str, list[float]]]:
    """Runs (label -> a report's metrics.json) side by side: the header, one row per (run, data set), and the
    zero-shot and linear-probe numbers per column. Percentages for accuracies and recalls."""
    header = ["run", "data set", *(title for _, _, title in COMPARED)]
    rows, numbers = [], {title: [] for _, _, title in COMPARED[:2]}
    for label, combined in runs.items():
        for dataset in _datasets(combined):
            cells = [label, dataset]
            for task, key, title in COMPARED:
                value = combined.get(f"{dataset}_{task}", {}).get(key)
                if value is None:
                    cells.append("-")
                    continue
                cells.append(f"{100 * value:.2f}%" if "R@" in key or key == "top1" else f"{value:.4g}")
                if title in numbers:
                    numbers[title].append(100 * value)
            rows.append(cells)
    return header, rows, numbers


def comparison_markdown(runs: dict[str, dict[str, dict]]) -> str:
    header, rows, _ = comparison_rows(runs)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def comparison_png(path: Path, runs: dict[str, dict[str, dict]]) -> str:
    """Grouped bars: zero-shot and linear-probe top-1 of each run (first data set of each)."""
    import matplotlib.pyplot as plt

    first = {label: _datasets(combined)[0] for label, combined in runs.items() if _datasets(combined)}
    labels = list(first)
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(labels) + 2), 3.6))
    for offset, (task, key, title) in enumerate(COMPARED[:2]):
        values = [100 * (runs[label].get(f"{first[label]}_{task}", {}).get(key) or 0.0) for label in labels]
        bars = ax.bar([i + (offset - 0.5) * 0.38 for i in range(len(labels))], values, width=0.38, label=title)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"objectives side by side ({first[labels[0]]})" if labels else "no runs")
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def _markdown(entries: dict[str, dict]) -> str:
    lines = ["# Evaluation report", ""]
    for name, entry in sorted(entries.items()):
        lines += [f"## {name}", "", f"model `{entry['model']}` from `{entry['pretrained']}`; "
                  f"full result: [{entry['record']}]({entry['record']})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in entry["scalars"].items()]
        lines.append("")
        lines += [f"![{plot}]({plot})" for plot in entry["plots"]]
        lines.append("")
    return "\n".join(lines)


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
