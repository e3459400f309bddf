"""What the evaluation tasks share: the options every task takes, the result a task returns, the record it writes
beside its figures, and the base of a task that runs on one image set."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from cloob_core.evaluation.features import Embedded, Encoding
from cloob_core.evaluation.inputs import CSV_COLUMNS, ImageSet, load_images
from cloob_core.evaluation.records import benchmark_record
from cloob_core.model.source import EvalModel


@dataclass(frozen=True)
class EvalOptions:
    """Settings every task shares: class names/templates, the label field of shards, the name results go under
    (a suite entry's; None: from the source), the feature cache and batch size."""

    classnames: str | None = None
    label_key: str = "label"
    name: str | None = None
    cache: Path | None = None  # None: no feature cache
    batch_size: int = 256
    progress: bool = True
    shared_features: Path | None = None  # features computed ahead, only read
    csv_columns: tuple[str, str] = CSV_COLUMNS  # a captions CSV's image and caption columns (--url-col, --caption-col)
    workers: int | None = None  # data-loader workers (None: from the thread budget)

    def images(self, source: str, split: str) -> ImageSet:
        images = load_images(source, split=split, label_key=self.label_key, class_file=self.classnames,
                             csv_columns=self.csv_columns)
        if self.name is not None:
            images.name = self.name
        return images

    @property
    def encoding(self) -> Encoding:
        return Encoding(self.cache, self.batch_size, self.progress, self.shared_features, self.workers)


@dataclass
class EvalResult:
    task: str
    output: Path
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # result name (data set) -> metrics
    lines: list[str] = field(default_factory=list)  # one human-readable line per result


def need(name: str, **fields: object) -> None:
    """A task's inputs (given by name: ``labels=...``) are there, or one line saying what the image set ``name``
    lacks."""
    missing = [f for f, value in fields.items() if value is None]
    if missing:
        hints = {"labels": "a class per image (ImageFolder, shards with a class field, a packaged set)",
                 "classnames": "class names (--classnames FILE)", "templates": "prompt templates (--classnames FILE "
                 "with a 'templates' list)", "captions": "captions (shards, a captions .csv, a packaged set)"}
        raise ValueError(f"{name}: this task needs " + "; ".join(hints[f] for f in missing))


def task_record(model: EvalModel, images: ImageSet, task: str, metrics: dict[str, Any],
                warnings: list[str] | None = None, embedded: Embedded | None = None) -> dict[str, Any]:
    """The result as CLIP_benchmark writes it; ``warnings`` (what makes a figure less than it seems) beside it,
    shown in the report; from ``embedded`` (the set as read), its unreadable samples and the precision its image
    features were computed at."""
    if embedded is not None and embedded.skipped:  # the figures cover fewer images than the set holds: say so
        metrics["skipped_unreadable"] = embedded.skipped
    record = benchmark_record(images.name, model.architecture, model.source, task, metrics)
    if embedded is not None:
        record["precision"] = embedded.precision
    if warnings:
        record["warnings"] = list(warnings)
    return record


@dataclass(frozen=True)
class OneSetTask:
    """A task on one image set: ``measure`` gives its metrics, ``line`` says them in one line."""

    name: ClassVar[str]
    data: str = "captioned"
    split: str = "test"

    def run(self, model: EvalModel, options: EvalOptions, output: Path) -> EvalResult:
        images = options.images(self.data, self.split)
        metrics = self.measure(model, images, options, output)
        return EvalResult(self.name, output, {images.name: metrics}, [f"{images.name} {self.line(metrics)}"])

    def measure(self, model: EvalModel, images: ImageSet, options: EvalOptions, output: Path) -> dict[str, Any]:
        raise NotImplementedError

    def line(self, metrics: dict[str, Any]) -> str:
        raise NotImplementedError
