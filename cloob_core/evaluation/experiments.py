"""Reading DVC experiments back: ``dvc exp show --json`` lists the workspace, the baseline commit and each
experiment with its params and metrics files; this picks out each run's report so `cloob eval compare` can put
the objectives (or any other ablation) side by side."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


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
