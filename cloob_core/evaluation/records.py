"""Evaluation results as records, in the formats their readers use: CLIP_benchmark's JSON per (model, data set,
task), a combined ``metrics.json`` for DVC, and the Markdown page (``report.md``) that links them and their plots."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core import lease, storage
from cloob_core.config import ConfigError
from cloob_core.evaluation.tables import comparison_rows, markdown_table, suite_rows
from cloob_core.io import atomic_write, write_json, write_text


def benchmark_record(dataset: str, model: str, pretrained: str, task: str, metrics: dict[str, Any]) -> dict:
    """CLIP_benchmark's result layout."""
    return {"dataset": dataset, "model": model, "pretrained": pretrained, "task": task, "metrics": metrics,
            "language": "en"}


def write_result(output: Path, record: dict, plots: Sequence[str] = ()) -> Path:
    """``<dataset>_<task>.json``, merged into ``metrics.json`` (scalars only), listed in ``report.md``."""
    name = f"{record['dataset']}_{record['task']}"
    write_json(output / f"{name}.json", record)
    combined = storage.read_json_or(output / "metrics.json", {})
    combined[name] = {k: v for k, v in record["metrics"].items() if isinstance(v, int | float)}
    write_json(output / "metrics.json", combined)
    entries = storage.read_json_or(output / ".report.json", {})
    entries[name] = {"record": f"{name}.json", "plots": list(plots), "model": record["model"],
                     "pretrained": record["pretrained"], "warnings": list(record.get("warnings", [])),
                     "scalars": combined[name]}
    write_json(output / ".report.json", entries)
    write_text(output / "report.md", _markdown(entries, {}))
    return output / f"{name}.json"


COMPLETE = "complete"  # the mark annotate() writes last into a suite result's index entry


def annotate(output: Path, names: Sequence[str], **fields: Any) -> None:
    """Add ``fields`` to the index entries of these results (what a report over them carries along)."""
    entries = storage.read_json_or(output / ".report.json", {})
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
        found = storage.read_json_or(folder / ".report.json", None)
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
    metrics = storage.read_json(path)
    if not isinstance(metrics, dict) or not all(isinstance(v, dict) for v in metrics.values()):
        raise ConfigError(f"{path} is not a report's metrics.json (an object of results, each an object of "
                          "metrics)")
    return metrics


def _markdown(entries: dict[str, dict], suite: dict[str, dict[str, float]]) -> str:
    lines = ["# Evaluation report", ""]
    combined = {name: entry["scalars"] for name, entry in entries.items()} | suite
    header, rows, _ = comparison_rows({"": combined})
    if len(rows) > 1 or suite:
        lines += ["## Summary", "", *markdown_table(header[1:], [row[1:] for row in rows]), ""]
    suite_header, suite_table = suite_rows({"": combined})
    if suite_table:
        lines += [*markdown_table(["", *suite_header[1:]], [["suite mean", *suite_table[0][1:]]]), ""]
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
