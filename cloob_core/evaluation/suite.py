"""The evaluation suite (``eval`` in the configuration) as stages: each data set evaluated on its tasks, then one
report over all of them with the suite's aggregates.

The DVC pipeline runs :func:`evaluate_suite` once per data set (a ``foreach`` stage, so a changed entry re-runs
only its own stage); the Kubeflow pipelines run it once per data set x task. Both write the same folders, one per
data set, which :func:`cloob_core.evaluation.suite_report.suite_report` combines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloob_core import lease, publish, scratch, storage
from cloob_core.config import DatasetConfig, EvalConfig, result_name
from cloob_core.evaluation.fingerprint import dataset_fingerprint
from cloob_core.evaluation.records import COMPLETE, annotate
from cloob_core.evaluation.run import EvalTask
from cloob_core.evaluation.suite_plan import naming_entry, plan_suite
from cloob_core.evaluation.tasks.common import EvalOptions
from cloob_core.evaluation.tasks.diagnostics import DiagnosticsTask
from cloob_core.evaluation.tasks.linear_probe import LinearProbeTask
from cloob_core.evaluation.tasks.retrieval import RetrievalTask
from cloob_core.evaluation.tasks.zeroshot import ZeroShotTask
from cloob_core.model.source import ModelSource


@dataclass
class DatasetResult:
    dataset: str
    output: Path
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # result name -> metrics
    lines: list[str] = field(default_factory=list)


def _task(entry: DatasetConfig, task: str) -> EvalTask:
    splits = entry.splits
    if task == "zeroshot":
        return ZeroShotTask(data=(entry.source,), split=splits.test)
    if task == "linear-probe":
        return LinearProbeTask(train_data=entry.source, train_split=splits.train, test_split=splits.test,
                               val_data=entry.source if splits.val else None, val_split=splits.val or "val",
                               few_shot=entry.few_shot)
    return (RetrievalTask if task == "retrieval" else DiagnosticsTask)(data=entry.source, split=splits.test)


def _options(settings: EvalConfig, name: str, cache: Path | None, progress: bool,
             shared_features: Path | None = None, workers: int | None = None) -> EvalOptions:
    entry = settings.datasets[name]
    return EvalOptions(classnames=entry.classnames, label_key=entry.label_key, name=name, cache=cache,
                       batch_size=entry.batch_size, progress=progress, shared_features=shared_features,
                       workers=workers)


def evaluate_suite(settings: EvalConfig, model: ModelSource, output: str | Path, *,
                   datasets: Sequence[str] | None = None, tasks: Sequence[str] | None = None,
                   cache: Path | None = None, shared_features: Path | None = None,
                   progress: bool = True, workers: int | None = None) -> list[DatasetResult]:
    """``cloob eval suite``: each named data set (default: all) on its tasks (or the given ones among them), into
    ``output/<data set>``. Every entry is checked before the model is loaded; the tasks of a data set share its
    features (through ``cache``, or a scratch cache for this call; ``shared_features``: computed ahead by
    :func:`prepare_features`)."""
    from cloob_core.model.source import load_model

    plan = plan_suite(settings, datasets, tasks)
    fingerprints = {name: dataset_fingerprint(settings.datasets[name]) for name in plan}  # the data as evaluated
    with lease.writing(output):  # after the checks: a refused suite creates no folder
        loaded = load_model(model)
        results = []
        with scratch.folder("cloob-features") as features:
            for name, chosen in plan.items():
                entry, folder = settings.datasets[name], Path(output) / name
                options = _options(settings, name, cache or features, progress, shared_features, workers)
                result = DatasetResult(name, folder)
                # the data set's results appear together when its tasks are done: a run stopped part-way changes
                # nothing there (results of its other tasks, evaluated before, are kept)
                with publish.staged(folder, keep=True) as staging:
                    for task in chosen:
                        with naming_entry(name):
                            done = _task(entry, task).run(loaded, options, staging)
                        result.metrics.update({result_name(name, task): m for m in done.metrics.values()})
                        result.lines += done.lines
                    annotate(staging, list(result.metrics), fingerprint=fingerprints[name], **{COMPLETE: True})
                results.append(result)
    return results


def prepare_features(settings: EvalConfig, name: str, model: ModelSource, output: str | Path, *,
                     progress: bool = True) -> list[str]:
    """The image features every task of data set ``name`` reads (its test split; train and val for the linear
    probe), computed once into the cache folder ``output``: the Kubeflow pipelines give it to each of the data
    set's task steps as their shared features. Returns the data set's tasks."""
    from cloob_core.evaluation.features import image_features
    from cloob_core.model.source import load_model

    tasks = plan_suite(settings, [name])[name]
    splits = settings.datasets[name].splits
    needed = [splits.test] + ([splits.train, *([splits.val] if splits.val else [])] if "linear-probe" in tasks
                              else [])
    storage.ensure_folder(output)
    loaded = load_model(model)
    options = _options(settings, name, Path(output), progress)
    for split in dict.fromkeys(needed):
        image_features(loaded, options.images(settings.datasets[name].source, split), options.encoding)
    return tasks
