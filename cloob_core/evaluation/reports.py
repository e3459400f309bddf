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

from cloob_core import lease, storage
from cloob_core.config import SUITE_RESULT, TASK_RESULTS, ConfigError
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
                     "pretrained": record["pretrained"], "warnings": list(record.get("warnings", [])),
                     "scalars": combined[name]}
    write_json(output / ".report.json", entries)
    write_text(output / "report.md", _markdown(entries, {}))
    return output / f"{name}.json"


COMPLETE = "complete"  # the mark annotate() writes last into a suite result's index entry


def annotate(output: Path, names: Sequence[str], **fields: Any) -> None:
    """Add ``fields`` to the index entries of these results (what a report over them carries along)."""
    entries = read_json_or(output / ".report.json", {})
    for name in names:
        entries[name].update(fields)
    write_json(output / ".report.json", entries)


@dataclass(frozen=True)
class Report:
    output: Path
    metrics: dict[str, dict]  # the scalars of each result (data set x task), as in OUTPUT/metrics.json
    entries: dict[str, dict]  # the index: each result's record, plots, model and what the suite annotated


@lease.holding("output")
def combine_reports(inputs: Sequence[Path], output: Path, *, keep: set[str] | None = None,
                    suite: dict[str, dict[str, float]] | None = None) -> Report:
    """One report over several evaluation folders (the DVC pipeline evaluates each data set into its own, since
    DVC outputs may not overlap; the Kubeflow pipelines each data set x task): their scalars in
    ``OUTPUT/metrics.json``, their records in ``OUTPUT/results/``, their plots in ``OUTPUT/figures/`` (a folder DVC
    shows as image plots), and ``OUTPUT/report.md`` linking both. ``keep``: only these results; ``suite``: results
    computed over the others (the suite's aggregates)."""
    storage.ensure_folder(output)
    entries: dict[str, dict] = {}
    for folder in inputs:
        found = read_json_or(folder / ".report.json", None)
        if not found:
            raise ConfigError(f"{folder} holds no evaluation results (no .report.json); run `cloob eval` into it "
                              "first")
        for name, entry in found.items():
            if keep is not None and name not in keep:
                continue
            if name in entries:
                raise ConfigError(f"result {name} appears in two input folders")
            moved = {**entry, "record": f"results/{Path(entry['record']).name}",
                     "plots": [f"figures/{Path(p).name}" for p in entry["plots"]]}
            for source, target in zip((entry["record"], *entry["plots"]), (moved["record"], *moved["plots"]),
                                      strict=True):
                atomic_write(output / target, lambda tmp, src=folder / source: shutil.copyfile(src, tmp))
            entries[name] = moved
    combined = {name: entry["scalars"] for name, entry in sorted(entries.items())}
    combined.update(suite or {})
    write_json(output / "metrics.json", combined)
    write_json(output / ".report.json", entries)  # so a combined report can be combined again
    write_text(output / "report.md", _markdown(entries, suite or {}))
    return Report(output, combined, entries)


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


# (result kind, scalar, column title): each data set's headline, in summaries and comparisons of runs
COLUMNS = (("zeroshot_classification", "acc1", "zero-shot acc1"), ("linear_probe", "lp_acc1", "linear-probe acc1"),
           ("zeroshot_retrieval", "text_retrieval_recall@1", "image->text R@1"),
           ("zeroshot_retrieval", "text_retrieval_recall@5", "image->text R@5"),
           ("zeroshot_retrieval", "image_retrieval_recall@1", "text->image R@1"),
           ("zeroshot_retrieval", "image_retrieval_recall@5", "text->image R@5"),
           ("diagnostics", "effective_eigenvalues_image", "effective eigenvalues (image)"))


def _as_percent(key: str) -> bool:
    """Accuracies and recalls (and aggregates of them, by their names) are shown as percentages."""
    return "acc" in key or "recall" in key


def _cell(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.2f}%" if _as_percent(key) else f"{value:.4g}"


def _datasets(combined: dict[str, dict]) -> list[str]:
    """The data sets a report has results for (result names are ``<data set>_<result>``)."""
    kinds = set(TASK_RESULTS.values())
    return sorted({name[: -len(kind) - 1] for name in combined for kind in kinds if name.endswith(f"_{kind}")})


def comparison_rows(runs: dict[str, dict[str, dict]]) -> tuple[list[str], list[list[str]], dict[str, list[float]]]:
    """Runs (label -> a report's metrics.json) side by side: the header, one row per (run, data set), and the
    zero-shot and linear-probe numbers per column (in %)."""
    header = ["run", "data set", *(title for _, _, title in COLUMNS)]
    rows, numbers = [], {title: [] for _, _, title in COLUMNS[:2]}
    for label, combined in runs.items():
        for dataset in _datasets(combined):
            cells = [label, dataset]
            for kind, key, title in COLUMNS:
                value = combined.get(f"{dataset}_{kind}", {}).get(key)
                cells.append(_cell(key, value))
                if title in numbers and value is not None:
                    numbers[title].append(100 * value)
            rows.append(cells)
    return header, rows, numbers


def suite_rows(runs: dict[str, dict[str, dict]]) -> tuple[list[str], list[list[str]]]:
    """The suite's aggregates of each run: the header (run, then each aggregate) and one row per run."""
    names = list(dict.fromkeys(name for combined in runs.values() for name in combined.get(SUITE_RESULT, {})))
    rows = [[label, *(_cell(name, runs[label].get(SUITE_RESULT, {}).get(name)) for name in names)]
            for label in runs if runs[label].get(SUITE_RESULT)]
    return ["run", *(f"{SUITE_RESULT}.{name}" for name in names)], rows


def _aligned(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return [indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def summary_table(combined: dict[str, dict]) -> str:
    """Each data set's headline numbers and the suite's aggregates, for a terminal."""
    header, rows, _ = comparison_rows({"": combined})
    lines = ["evaluation summary", *_aligned(header[1:], [row[1:] for row in rows])]
    suite = combined.get(SUITE_RESULT, {})
    if suite:
        lines.append(f"suite means over {len(rows)} data sets")
        lines += _aligned(["aggregate", "value"], [[f"{SUITE_RESULT}.{name}", _cell(name, value)]
                                                   for name, value in suite.items()])
    return "\n".join(lines)


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def comparison_markdown(runs: dict[str, dict[str, dict]]) -> str:
    header, rows, _ = comparison_rows(runs)
    lines = _markdown_table(header, rows)
    suite_header, suite = suite_rows(runs)
    if suite:
        lines += ["", *_markdown_table(suite_header, suite)]
    return "\n".join(lines) + "\n"


def comparison_png(path: Path, runs: dict[str, dict[str, dict]]) -> str:
    """Grouped bars per run: the suite's aggregates where the runs have them, else zero-shot and linear-probe
    top-1 of each run's first data set."""
    import matplotlib.pyplot as plt

    labels = list(runs)
    names = list(dict.fromkeys(name for combined in runs.values() for name in combined.get(SUITE_RESULT, {})))
    if names:
        series = {f"{SUITE_RESULT}.{name}": [runs[label].get(SUITE_RESULT, {}).get(name) for label in labels]
                  for name in names}
        title = "suite means per run"
    else:
        first = {label: (_datasets(combined) or [""])[0] for label, combined in runs.items()}
        series = {title: [runs[label].get(f"{first[label]}_{kind}", {}).get(key) for label in labels]
                  for kind, key, title in COLUMNS[:2]}
        title = f"runs side by side ({first[labels[0]]})" if labels else "no runs"
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(labels) + 2), 3.6))
    width = 0.8 / max(len(series), 1)
    for offset, (name, values) in enumerate(series.items()):
        shown = [100 * v if v is not None and _as_percent(name) else (v or 0.0) for v in values]
        bars = ax.bar([i + (offset - (len(series) - 1) / 2) * width for i in range(len(labels))], shown, width=width,
                      label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
    ax.set_ylabel("% (accuracies and recalls)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


def _markdown(entries: dict[str, dict], suite: dict[str, dict[str, float]]) -> str:
    lines = ["# Evaluation report", ""]
    combined = {name: entry["scalars"] for name, entry in entries.items()} | suite
    header, rows, _ = comparison_rows({"": combined})
    if len(rows) > 1 or suite:
        lines += ["## Summary", "", *_markdown_table(header[1:], [row[1:] for row in rows]), ""]
    suite_header, suite_table = suite_rows({"": combined})
    if suite_table:
        lines += [*_markdown_table(["", *suite_header[1:]], [["suite mean", *suite_table[0][1:]]]), ""]
    for name, entry in sorted(entries.items()):
        lines += [f"## {name}", "", f"model `{entry['model']}` from `{entry['pretrained']}`; "
                  f"full result: [{entry['record']}]({entry['record']})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |"
                  for k, v in entry["scalars"].items()]
        lines.append("")
        lines += [f"> **warning:** {warning}" for warning in entry.get("warnings", [])]
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
