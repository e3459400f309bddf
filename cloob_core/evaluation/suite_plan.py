"""The suite's plan: which data sets and tasks run, every entry checked (its source and splits there, its classes
rankable) before a model is loaded. Apart from :mod:`cloob_core.evaluation.suite` so that a step that only plans
(the Kubeflow pipelines' fan-out) does not load torch and open_clip to do it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from cloob_core import storage
from cloob_core.config import PACKAGED_SOURCES, TASK_RESULTS, DatasetConfig, EvalConfig
from cloob_core.data.wds_layout import CLASSNAMES_FILE
from cloob_core.errors import one_line, user_facing
from cloob_core.evaluation.class_sets import packaged_class_sets
from cloob_core.evaluation.suite_error import SuiteError

SPLIT_FOLDERS = ("train", "test", "val", "validation")  # what marks an ImageFolder tree as split into subfolders


def _chosen(settings: EvalConfig, names: Sequence[str] | None) -> list[str]:
    unknown = [name for name in names or () if name not in settings.datasets]
    if unknown:
        raise SuiteError(f"no data set named {unknown} in eval.datasets ({', '.join(settings.datasets)})")
    return list(names) if names else list(settings.datasets)


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
