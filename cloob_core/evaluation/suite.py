"""The evaluation suite (``eval`` in the configuration) as stages: each data set evaluated on its tasks, then one
report over all of them with the suite's aggregates.

The DVC pipeline runs :func:`evaluate_suite` once per data set (a ``foreach`` stage, so a changed entry re-runs
only its own stage); the Kubeflow pipelines run it once per data set x task. Both write the same folders, one per
data set, which :func:`cloob_core.evaluation.suite_report.suite_report` combines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloob_core import lease, publish, scratch, storage
from cloob_core.config import PACKAGED_SOURCES, TASK_RESULTS, DatasetConfig, EvalConfig, result_name
from cloob_core.data.wds_layout import CLASSNAMES_FILE
from cloob_core.errors import one_line, user_facing
from cloob_core.evaluation.class_sets import packaged_class_sets
from cloob_core.evaluation.fingerprint import dataset_fingerprint
from cloob_core.evaluation.records import COMPLETE, annotate
from cloob_core.evaluation.run import EvalTask
from cloob_core.evaluation.suite_error import SuiteError
from cloob_core.evaluation.tasks.common import EvalOptions
from cloob_core.evaluation.tasks.diagnostics import DiagnosticsTask
from cloob_core.evaluation.tasks.linear_probe import LinearProbeTask
from cloob_core.evaluation.tasks.retrieval import RetrievalTask
from cloob_core.evaluation.tasks.zeroshot import ZeroShotTask
from cloob_core.model.source import ModelSource

SPLIT_FOLDERS = ("train", "test", "val", "validation")  # what marks an ImageFolder tree as split into subfolders


@dataclass
class DatasetResult:
    dataset: str
    output: Path
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # result name -> metrics
    lines: list[str] = field(default_factory=list)


def _chosen(settings: EvalConfig, names: Sequence[str] | None) -> list[str]:
    unknown = [name for name in names or () if name not in settings.datasets]
    if unknown:
        raise SuiteError(f"no data set named {unknown} in eval.datasets ({', '.join(settings.datasets)})")
    return list(names) if names else list(settings.datasets)


def _task(entry: DatasetConfig, task: str) -> EvalTask:
    splits = entry.splits
    if task == "zeroshot":
        return ZeroShotTask(data=(entry.source,), split=splits.test)
    if task == "linear-probe":
        return LinearProbeTask(train_data=entry.source, train_split=splits.train, test_split=splits.test,
                               val_data=entry.source if splits.val else None, val_split=splits.val or "val",
                               few_shot=entry.few_shot)
    return (RetrievalTask if task == "retrieval" else DiagnosticsTask)(data=entry.source, split=splits.test)


def _split_there(source: str, split: str) -> bool | None:
    """Whether ``source`` has ``split``: True/False where the layout tells, None where it has no splits (a flat
    ImageFolder tree, shards, a .csv: the whole source is the one split)."""
    from cloob_core.evaluation.inputs import is_wds_set

    if is_wds_set(source, split):
        return True
    if any(is_wds_set(source, other) for other in SPLIT_FOLDERS):
        return False
    if not storage.is_s3(source) and Path(source).is_dir() and not (Path(source) / "sizes.json").exists():
        if (Path(source) / split).is_dir():
            return True
        return False if any((Path(source) / other).is_dir() for other in SPLIT_FOLDERS) else None
    return None


CLASSIFYING = ("zeroshot", "linear-probe")  # the tasks that rank classes


@contextlib.contextmanager
def naming_entry(name: str) -> Iterator[None]:
    """A user's error inside the block (a missing bucket, an unreadable folder, data that cannot be ranked) as
    one line that names ``eval.datasets.NAME``."""
    where = f"eval.datasets.{name}"
    try:
        yield
    except Exception as err:
        if str(err).startswith(where) or not user_facing(err):
            raise
        raise SuiteError(f"{where}: {one_line(err)}") from None


def check_entry(name: str, entry: DatasetConfig, tasks: Sequence[str]) -> None:
    """What can be known before a model is loaded: the source and its splits are there, the class list exists,
    and the classes can be ranked (at least two, none without images)."""
    with naming_entry(name):
        _check_entry(f"eval.datasets.{name}", entry, tasks)


def _check_entry(where: str, entry: DatasetConfig, tasks: Sequence[str]) -> None:
    needed = {entry.splits.test} | ({entry.splits.train} | ({entry.splits.val} if entry.splits.val else set())
                                    if "linear-probe" in tasks else set())
    if entry.source in PACKAGED_SOURCES and not needed <= {"train", "test"}:
        raise SuiteError(f"{where}: {entry.source} has the splits train and test, not "
                         f"{', '.join(sorted(needed - {'train', 'test'}))}")
    if entry.source not in PACKAGED_SOURCES:
        try:
            found = storage.exists(entry.source)
        except Exception as err:  # a bucket that does not exist, access denied, a store that does not answer
            if not user_facing(err):
                raise
            raise SuiteError(f"{where}: source {entry.source} cannot be read: {one_line(err)}") from None
        if not found:
            raise SuiteError(f"{where}: source {entry.source} does not exist")
        for split in sorted(needed):
            there = _split_there(entry.source, split)
            if there is False:
                raise SuiteError(f"{where}: {entry.source} has no split {split!r}")
            if there is None and split == entry.splits.train and "linear-probe" in tasks:
                raise SuiteError(f"{where}: the linear probe needs separate train and test images, and "
                                 f"{entry.source} has no splits (give a tree with train/ and test/ inside)")
            if set(tasks) & set(CLASSIFYING):
                _check_classes(where, entry.source, split if there else None)
    if entry.classnames and entry.classnames not in packaged_class_sets() and not storage.exists(entry.classnames):
        raise SuiteError(f"{where}: classnames {entry.classnames!r} is no file and no packaged class list "
                         f"({', '.join(packaged_class_sets())})")


def _check_classes(where: str, source: str, split: str | None) -> None:
    """An ImageFolder split: every class folder holds an image, and there are at least two classes; a
    CLIP_benchmark ``wds`` set: at least two class names."""
    from cloob_core.evaluation.inputs import is_wds_set

    if split is not None and is_wds_set(source, split):
        names = storage.read_bytes(storage.join(source, CLASSNAMES_FILE)).decode().split("\n")
        classes = [line for line in names if line.strip()]
    elif not storage.is_s3(source) and Path(source).is_dir() and not (Path(source) / "sizes.json").exists():
        from torchvision.datasets.folder import IMG_EXTENSIONS

        folder = Path(source, split) if split else Path(source)
        classes = sorted(path.name for path in folder.iterdir() if path.is_dir())
        empty = [c for c in classes if not any(f.suffix.lower() in IMG_EXTENSIONS for f in (folder / c).rglob("*"))]
        if empty:
            raise SuiteError(f"{where}: {folder} has class folders without images ({', '.join(empty[:5])}"
                             f"{', ...' if len(empty) > 5 else ''}); remove them or add images")
    else:
        return  # shards: the classes are in the samples, checked when they are read
    if len(classes) < 2:
        raise SuiteError(f"{where}: {source} has {len(classes)} class{'es' if len(classes) != 1 else ''}"
                         f"{f' ({classes[0]})' if classes else ''}: zero-shot and the linear probe rank at least "
                         "two (with one, every answer is right by construction)")


def plan_suite(settings: EvalConfig, datasets: Sequence[str] | None = None,
               tasks: Sequence[str] | None = None) -> dict[str, list[str]]:
    """The data sets to evaluate (default: all) and the tasks of each (its own, or those of ``tasks`` among them),
    every entry checked: the failure names the entry before anything is loaded."""
    unknown = sorted(set(tasks or ()) - set(TASK_RESULTS))
    if unknown:
        raise SuiteError(f"unknown task {unknown}; choose from {', '.join(TASK_RESULTS)}")
    plan = {}
    for name in _chosen(settings, datasets):
        entry = settings.datasets[name]
        chosen = [task for task in entry.tasks if tasks is None or task in tasks]
        if chosen:
            check_entry(name, entry, chosen)
            plan[name] = chosen
    if not plan:
        raise SuiteError(f"no data set of {', '.join(datasets or settings.datasets)} runs {', '.join(tasks or [])} "
                         "in eval.datasets")
    return plan


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
