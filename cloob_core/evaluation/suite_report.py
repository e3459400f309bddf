"""The evaluation suite's report: the results of its data sets gathered into one, and its aggregates (the
``suite`` result) computed from them. Apart from :mod:`cloob_core.evaluation.suite` so that the report needs no
model code."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cloob_core.config import SUITE_RESULT, ConfigError, EvalConfig, result_name
from cloob_core.evaluation.reports import Report, combine_reports, read_metrics


class SuiteError(ConfigError):
    """A suite entry that cannot be evaluated, or results that do not cover the suite; names the entry."""


def aggregate(settings: EvalConfig, metrics: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each aggregate of the suite: the mean of its metrics over its data sets (CLIP_benchmark's table means)."""
    values: dict[str, float] = {}
    for name, spec in settings.aggregates.items():
        collected = []
        for metric in spec.of:
            result, _, key = metric.partition(".")
            for dataset in settings.contributors(name, result):
                scalars = metrics.get(f"{dataset}_{result}", {})
                if key not in scalars:
                    raise SuiteError(f"eval.aggregates.{name}: {dataset}_{result} has no metric {key!r} (it has "
                                     f"{', '.join(sorted(scalars)) or 'no results'})")
                collected.append(float(scalars[key]))
        values[name] = statistics.fmean(collected)
    return values


def suite_report(settings: EvalConfig, inputs: Sequence[str | Path], output: str | Path) -> Report:
    """``cloob eval report --params``: the suite's results in one report, plus its aggregates as the ``suite``
    result. Each input is a results folder (it has ``.report.json``) or a folder of them, one per data set (what
    `cloob eval suite` writes). Results outside the suite (a data set since removed from it) are left out; a
    result the suite needs that no input has is an error naming it."""
    folders = []
    for given in map(Path, inputs):
        if (given / ".report.json").is_file():
            folders.append(given)
        else:
            folders += [given / name for name in settings.datasets if (given / name / ".report.json").is_file()]
    needed = {result_name(name, task) for name, entry in settings.datasets.items() for task in entry.tasks}
    found: dict[str, dict[str, Any]] = {}
    for folder in folders:
        found |= {name: scalars for name, scalars in read_metrics(folder / "metrics.json").items() if name in needed}
    missing = sorted(needed - set(found))
    if missing:
        raise SuiteError(f"no results for {', '.join(missing)} in {', '.join(map(str, inputs))}; run `cloob eval "
                         "suite` for those data sets first")
    return combine_reports(folders, Path(output), keep=needed, suite={SUITE_RESULT: aggregate(settings, found)})
