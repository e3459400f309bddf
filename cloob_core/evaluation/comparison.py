"""``cloob eval compare``: several runs side by side. Runs are report files, or DVC experiments read back from
``dvc exp show --json`` (the workspace, the baseline commit and each experiment with its params and metrics
files), so the objectives (or any other ablation) can be compared in one table."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloob_core.config import ConfigError


def _runs(node: Any) -> Iterator[dict[str, Any]]:
    """Every entry carrying ``data`` with metrics, depth first (experiments nest under their baseline)."""
    if isinstance(node, list):
        for item in node:
            yield from _runs(item)
    elif isinstance(node, dict):
        if isinstance(node.get("data"), dict) and "metrics" in node["data"]:
            yield node
        for key in ("experiments", "revs"):
            if node.get(key):
                yield from _runs(node[key])


def _file_data(files: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    entry = (files or {}).get(name)
    return entry.get("data") if isinstance(entry, dict) else None


def runs_from_dvc_exp_show(shown: Any, metrics_file: str = "reports/metrics.json",
                           params_file: str = "params.yaml") -> dict[str, dict[str, dict]]:
    """Label -> the run's ``metrics_file``; the label is the experiment's name (or short revision) and its
    ``train.objective``. Entries without that metrics file (failed or not yet run) are left out; the workspace
    is left out when a committed entry has the same results."""
    found = []
    for entry in _runs(shown):
        data = entry["data"]
        metrics = _file_data(data.get("metrics"), metrics_file)
        if metrics:
            found.append((entry, data, metrics))
    committed = [metrics for entry, _, metrics in found if entry.get("rev") != "workspace"]
    runs: dict[str, dict[str, dict]] = {}
    for entry, data, metrics in found:
        if entry.get("rev") == "workspace" and metrics in committed:
            continue
        params = _file_data(data.get("params"), params_file) or {}
        objective = (params.get("train") or {}).get("objective", "?")
        name = entry.get("name") or str(entry.get("rev") or data.get("rev", "?"))[:7]
        label = name if objective in name else f"{name} ({objective})"
        while label in runs:
            label += "'"
        runs[label] = metrics
    return runs


@dataclass
class Comparison:
    table: str  # Markdown
    runs: dict[str, dict[str, dict]]
    written: list[Path] = field(default_factory=list)


def compare_runs(run_files: Sequence[str] = (), dvc_exps: str | None = None,
                 metrics_file: str = "reports/metrics.json", output: str | Path | None = None) -> Comparison:
    """``cloob eval compare``: runs given as ``LABEL=metrics.json`` and/or the experiments of a ``dvc exp show
    --json`` file, as one Markdown table (and, with ``output``, comparison.md and a bar chart there)."""
    from cloob_core import storage
    from cloob_core.evaluation.figures import comparison_png
    from cloob_core.evaluation.records import read_metrics
    from cloob_core.evaluation.tables import comparison_markdown
    from cloob_core.io import write_text

    runs: dict[str, dict[str, dict]] = {}
    for spec in run_files:
        label, _, path = spec.partition("=")
        if not path or not Path(path).is_file():
            raise ConfigError(f"--run {spec!r}: expected LABEL=PATH to a report's metrics.json")
        runs[label] = read_metrics(path)
    if dvc_exps:
        runs.update(runs_from_dvc_exp_show(storage.read_json(dvc_exps), metrics_file))
    if not runs:
        raise ConfigError("nothing to compare: give --run LABEL=metrics.json or --dvc-exps exps.json")
    comparison = Comparison(comparison_markdown(runs), runs)
    if output is not None:
        folder = Path(output)
        comparison.written = [write_text(folder / "comparison.md", comparison.table),
                              folder / comparison_png(folder / "comparison.png", runs)]
    return comparison
