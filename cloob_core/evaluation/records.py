"""Evaluation results as records, in the formats their readers use: CLIP_benchmark's JSON per (model, data set,
task), a combined ``metrics.json`` for DVC, and the Markdown page (``report.md``) that links them and their plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core import lease, publish, storage
from cloob_core.config import ConfigError
from cloob_core.evaluation.tables import comparison_rows, markdown_table, suite_rows
from cloob_core.io import atomic_write, parse_json, write_json, write_text
from cloob_core.model.files import INFO_FILE


def benchmark_record(dataset: str, model: str, pretrained: str, task: str, metrics: dict[str, Any]) -> dict:
    """CLIP_benchmark's result layout."""
    return {"dataset": dataset, "model": model, "pretrained": pretrained, "task": task, "metrics": metrics,
            "language": "en"}


def write_result(output: Path, record: dict, model_id: str, plots: Sequence[str] = ()) -> Path:
    """``<dataset>_<task>.json``, merged into ``metrics.json`` (scalars only), listed in ``report.md``; the index
    entry names the model by ``model_id`` (its weights' digest), which the promotion gate checks."""
    name = f"{record['dataset']}_{record['task']}"
    write_json(output / f"{name}.json", record)
    combined = storage.read_json_or(output / "metrics.json", {})
    combined[name] = {k: v for k, v in record["metrics"].items() if isinstance(v, int | float)}
    write_json(output / "metrics.json", combined)
    entries = storage.read_json_or(output / INDEX_FILE, {})
    entries[name] = {"record": f"{name}.json", "plots": list(plots), "model": record["model"],
                     "pretrained": record["pretrained"], "model_id": model_id,
                     "warnings": list(record.get("warnings", [])), "scalars": combined[name]}
    write_json(output / INDEX_FILE, entries)
    write_text(output / "report.md", _markdown(entries, {}))
    return output / f"{name}.json"


INDEX_FILE = ".report.json"  # an evaluation folder's index: each result's record, plots, model and scalars
COMPLETE = "complete"  # the mark annotate() writes last into a suite result's index entry


def annotate(output: Path, names: Sequence[str], **fields: Any) -> None:
    """Add ``fields`` to the index entries of these results (what a report over them carries along)."""
    entries = storage.read_json_or(output / INDEX_FILE, {})
    for name in names:
        entries[name].update(fields)
    write_json(output / INDEX_FILE, entries)


@dataclass(frozen=True)
class Report:
    output: Path
    metrics: dict[str, dict]  # the scalars of each result (data set x task), as in OUTPUT/metrics.json
    entries: dict[str, dict]  # the index: each result's record, plots, model and what the suite annotated


@dataclass(frozen=True)
class Results:
    """The results of evaluation folders, read and checked, not yet written: each result's index entry (its
    files renamed as a report holds them) and the bytes of those files."""

    entries: dict[str, dict]
    files: dict[str, bytes]

    @property
    def scalars(self) -> dict[str, dict]:
        return {name: entry["scalars"] for name, entry in sorted(self.entries.items())}


def gather_results(inputs: Sequence[Path], keep: set[str] | None = None) -> Results:
    """The results in evaluation folders (``keep``: only these). A folder's files are read through its published
    unit, so a folder a run left half-published, or a file changed since, is refused; so are results of more
    than one model."""
    entries: dict[str, dict] = {}
    files: dict[str, bytes] = {}
    for folder in inputs:
        unit = publish.unit_of(folder)
        read = unit.read if unit else (lambda name, folder=folder: (folder / name).read_bytes())
        found = parse_json(read(INDEX_FILE), str(folder / INDEX_FILE)) if unit or (folder / INDEX_FILE).is_file() \
            else None
        if not found:
            raise ConfigError(f"{folder} holds no evaluation results (no {INDEX_FILE}); run `cloob eval` into it "
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
                files[target] = read(source)
            entries[name] = moved
    models = sorted({str(entry.get("model_id")) for entry in entries.values()})
    if len(models) > 1:
        raise ConfigError(f"the results in {', '.join(map(str, inputs))} are of {len(models)} different models "
                          f"({', '.join(models)}): evaluate one model into them")
    return Results(entries, files)


def publish_report(results: Results, output: Path, suite: dict[str, dict[str, float]] | None = None,
                   extra: dict[str, Any] | None = None, model: dict[str, Any] | None = None) -> Report:
    """The report over ``results`` published in ``output`` as one unit (:mod:`cloob_core.publish`): their
    scalars in ``metrics.json``, their records in ``results/``, their plots in ``figures/`` (a folder DVC shows
    as image plots), ``report.md`` linking both, and ``extra`` files (name -> JSON). ``suite``: results computed
    over the others (the suite's aggregates); ``model``: the evaluated model's ``model_info.json``, which
    ``report.md`` describes (how it was trained, from which weights, on which sources)."""
    combined = results.scalars | (suite or {})
    with publish.staged(output) as staging:
        for target, data in results.files.items():
            atomic_write(staging / target, lambda tmp, data=data: tmp.write_bytes(data))
        for name, data in (extra or {}).items():
            write_json(staging / name, data)
        write_json(staging / "metrics.json", combined)
        write_json(staging / INDEX_FILE, results.entries)  # so a combined report can be combined again
        write_text(staging / "report.md", _markdown(results.entries, suite or {}, model))
    return Report(output, combined, results.entries)


@lease.holding("output")
def combine_reports(inputs: Sequence[Path], output: Path, model: str | Path | None = None) -> Report:
    """One report over several evaluation folders (the DVC pipeline evaluates each data set into its own, since
    DVC outputs may not overlap; the Kubeflow pipelines each data set x task). Nothing in ``output`` changes
    unless the whole report is published. ``model``: the evaluated model's folder, described in ``report.md``."""
    storage.ensure_folder(output)
    return publish_report(gather_results(inputs), output, model=model_about(model))


def model_about(folder: str | Path | None) -> dict[str, Any] | None:
    """A model folder's ``model_info.json`` (None without a folder); a folder without one is an error naming it."""
    if folder is None:
        return None
    location = storage.join(str(folder), INFO_FILE)
    try:
        about = storage.read_json(location)
    except FileNotFoundError:
        raise ConfigError(f"{folder} is not a `cloob train` model folder (no {INFO_FILE})") from None
    if not isinstance(about, dict):
        raise ConfigError(f"{location} does not describe a model (not a JSON object)")
    return about


def read_metrics(path: str | Path) -> dict[str, dict]:
    """A report's ``metrics.json`` (result name -> scalars)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; run the pipeline (dvc repro) or `cloob eval report` first")
    return parse_metrics(path.read_bytes(), path)


def parse_metrics(data: bytes, path: str | Path) -> dict[str, dict]:
    """``metrics.json``'s bytes as result name -> scalars; anything else is an error naming ``path``."""
    metrics = parse_json(data, str(path))
    if not isinstance(metrics, dict) or not all(isinstance(v, dict) for v in metrics.values()):
        raise ConfigError(f"{path} is not a report's metrics.json (an object of results, each an object of "
                          "metrics)")
    return metrics


def _markdown(entries: dict[str, dict], suite: dict[str, dict[str, float]], model: dict[str, Any] | None = None) -> str:
    lines = ["# Evaluation report", ""]
    combined = {name: entry["scalars"] for name, entry in entries.items()} | suite
    header, rows, _ = comparison_rows({"": combined})
    if len(rows) > 1 or suite:
        lines += ["## Summary", "", *markdown_table(header[1:], [row[1:] for row in rows]), ""]
    suite_header, suite_table = suite_rows({"": combined})
    if suite_table:
        lines += [*markdown_table(["", *suite_header[1:]], [["suite mean", *suite_table[0][1:]]]), ""]
    if model is not None:
        lines += _model_lines(model)
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


def _model_lines(about: dict[str, Any]) -> list[str]:
    """The evaluated model as its ``model_info.json`` describes it: architecture, objective and steps, the weights
    it started from, and each training source's share of the samples it saw."""
    trained = ", ".join(f"{label} {about[key]}" for key, label in (("architecture", "architecture"),
                                                                    ("objective", "objective"), ("steps", "steps"))
                        if key in about)
    lines = ["## Model", "", f"{trained}; started from {about.get('init_from') or 'random weights'}", ""]
    shares = about.get("source_shares")
    if isinstance(shares, dict) and shares:
        lines += markdown_table(["training source", "share of the samples seen"],
                                [[f"`{name}`", f"{float(share):.1%}"] for name, share in shares.items()])
        lines.append("")
    return lines
