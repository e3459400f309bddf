"""The evaluation suite's report: the results of its data sets gathered into one, and its aggregates (the
``suite`` result) computed from them. Apart from :mod:`cloob_core.evaluation.suite` so that the report needs no
model code."""

from __future__ import annotations

import logging
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cloob_core import lease
from cloob_core.config import SUITE_RESULT, EvalConfig, result_name
from cloob_core.evaluation.records import COMPLETE, INDEX_FILE, Report, gather_results, model_about, publish_report
from cloob_core.evaluation.suite_error import SuiteError
from cloob_core.io import json_digest

log = logging.getLogger(__name__)
SUITE_FILE = "suite.json"  # beside a suite report's metrics.json: the suite's fingerprint


def suite_fingerprint(settings: EvalConfig, datasets: dict[str, Any]) -> dict[str, Any]:
    """The suite's fingerprint from its data sets' (as their evaluations recorded them, see
    :mod:`cloob_core.evaluation.fingerprint`) and the aggregates' definitions, which decide what ``suite.*`` means;
    ``digest`` is what the promotion gate compares."""
    aggregates = {name: spec.model_dump() for name, spec in settings.aggregates.items()}
    return {"digest": json_digest({"datasets": datasets, "aggregates": aggregates}), "datasets": datasets,
            "aggregates": aggregates}


_TOP_K = re.compile(r"^(?:lp_)?acc(\d+)$")
_RECALL = re.compile(r"^(image|text)_retrieval_recall@(\d+)$")


def ranks_nothing(key: str, scalars: dict[str, Any]) -> bool:
    """Whether metric ``key`` is 100% by construction: top-k accuracy over k classes or fewer (chance 1), recall
    at k over k candidates or fewer. Such a figure measures nothing and never enters a suite mean."""
    if found := _TOP_K.match(key):
        chance = scalars.get("chance")
        return bool(chance) and round(1 / float(chance)) <= int(found.group(1))
    if found := _RECALL.match(key):
        candidates = scalars.get("images" if found.group(1) == "image" else "captions")
        return candidates is not None and int(candidates) <= int(found.group(2))
    return False


def aggregate(settings: EvalConfig, metrics: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Each aggregate of the suite: the mean of its metrics over its data sets (CLIP_benchmark's table means),
    leaving out figures that rank nothing (:func:`ranks_nothing`)."""
    values: dict[str, float] = {}
    for name, spec in settings.aggregates.items():
        collected, left_out = [], []
        for metric in spec.of:
            result, _, key = metric.partition(".")
            for dataset in settings.contributors(name, result):
                scalars = metrics.get(f"{dataset}_{result}", {})
                if key not in scalars:
                    raise SuiteError(f"eval.aggregates.{name}: {dataset}_{result} has no metric {key!r} (it has "
                                     f"{', '.join(sorted(scalars)) or 'no results'})")
                if ranks_nothing(key, scalars):
                    left_out.append(f"{dataset}_{result}.{key}")
                else:
                    collected.append(float(scalars[key]))
        if left_out:
            log.warning("eval.aggregates.%s leaves out %s: 100%% by construction (as few candidates as k)", name,
                        ", ".join(left_out))
        if not collected:
            raise SuiteError(f"eval.aggregates.{name}: every figure it averages ranks nothing ({', '.join(left_out)}"
                             "): give its data sets more classes or candidates than k")
        values[name] = statistics.fmean(collected)
    return values


@lease.holding("output")
def suite_report(settings: EvalConfig, inputs: Sequence[str | Path], output: str | Path,
                 model: str | Path | None = None) -> Report:
    """``cloob eval report --params``: the suite's results in one report, plus its aggregates as the ``suite``
    result and the suite's fingerprint (``suite.json``). Each input is a results folder (it has
    ``.report.json``) or a folder of them, one per data set (what `cloob eval suite` writes). Results outside the
    suite (a data set since removed from it) are left out. Everything is checked before anything is written: a
    result the suite needs that no input has, or one that is incomplete, is an error naming it, and ``output``
    stays as it was. ``model``: the evaluated model's folder, which ``report.md`` describes."""
    about = model_about(model)
    folders = []
    for given in map(Path, inputs):
        if (given / INDEX_FILE).is_file():
            folders.append(given)
        else:
            folders += [given / name for name in settings.datasets if (given / name / INDEX_FILE).is_file()]
    needed = {result_name(name, task) for name, entry in settings.datasets.items() for task in entry.tasks}
    results = gather_results(folders, keep=needed)
    missing = sorted(needed - set(results.entries))
    if missing:
        raise SuiteError(f"no results for {', '.join(missing)} in {', '.join(map(str, inputs))}; run `cloob eval "
                         "suite` for those data sets first")
    fingerprint = suite_fingerprint(settings, _dataset_fingerprints(settings, results.entries))
    return publish_report(results, Path(output), suite={SUITE_RESULT: aggregate(settings, results.scalars)},
                          extra={SUITE_FILE: fingerprint}, model=about)


def _dataset_fingerprints(settings: EvalConfig, entries: dict[str, dict]) -> dict[str, Any]:
    """Each data set's fingerprint as its evaluations recorded it; its tasks (separate Kubeflow steps) agree."""
    found: dict[str, Any] = {}
    for name, entry in settings.datasets.items():
        incomplete = [result_name(name, task) for task in entry.tasks
                      if not entries[result_name(name, task)].get(COMPLETE)]
        if incomplete:
            raise SuiteError(f"eval.datasets.{name}: {', '.join(incomplete)} is incomplete (its evaluation stopped "
                             "part-way); evaluate the data set again")
        recorded = [entries[result_name(name, task)].get("fingerprint") for task in entry.tasks]
        if any(value != recorded[0] for value in recorded):
            raise SuiteError(f"eval.datasets.{name}: its tasks were evaluated on different data or settings (their "
                             "fingerprints differ); evaluate them again")
        found[name] = recorded[0]
    return found
