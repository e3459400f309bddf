"""The ``cloob eval TASK`` stage: a task's settings and a model in, its results written and returned.

Each task is a small frozen dataclass whose fields are the task's options (the CLI builds it from its flags of
the same names, a Kubeflow step from defaults); :func:`evaluate` loads the model and the image sets the task
names and runs it, so the CLI and the Kubeflow step share everything but the printing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from cloob_core import lease, storage
from cloob_core.config import ConfigError
from cloob_core.evaluation import tasks
from cloob_core.evaluation.features import Encoding
from cloob_core.evaluation.inputs import EvalModel, ImageSet, load_images, load_model


@dataclass(frozen=True)
class ModelSource:
    """A `cloob train` export (``model``, local or s3://), or an open_clip ``architecture`` with ``weights``."""

    model: str | None = None
    architecture: str | None = None
    weights: str | None = None
    device: str = "cpu"


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

    def images(self, source: str, split: str) -> ImageSet:
        images = load_images(source, split=split, label_key=self.label_key, class_file=self.classnames)
        if self.name is not None:
            images.name = self.name
        return images

    @property
    def encoding(self) -> Encoding:
        return Encoding(self.cache, self.batch_size, self.progress, self.shared_features)


@dataclass
class EvalResult:
    task: str
    output: Path
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)  # result name (data set) -> metrics
    lines: list[str] = field(default_factory=list)  # one human-readable line per result


@dataclass(frozen=True)
class ZeroShotTask:
    """Prompt-ensemble zero-shot classification on each ``data`` set, and their mean when there are several."""

    name: ClassVar[str] = "zeroshot"
    data: tuple[str, ...] = ("captioned",)
    split: str = "test"
    hopfield_beta: float | None = None
    mean_name: str | None = None

    def __post_init__(self) -> None:
        if self.hopfield_beta is not None and not (math.isfinite(self.hopfield_beta) and self.hopfield_beta > 0):
            raise ConfigError(f"--hopfield-beta must be a finite number above 0, got {self.hopfield_beta}")

    def run(self, model: EvalModel, options: EvalOptions, output: Path) -> EvalResult:
        result = EvalResult(self.name, output)
        test_sets = [options.images(data, self.split) for data in self.data]
        for images in test_sets:
            metrics = tasks.zeroshot(model, images, output, options.encoding, self.hopfield_beta)
            top_k = next((key for key in metrics if key.startswith("acc") and key != "acc1"), "acc1")
            result.metrics[images.name] = metrics
            result.lines.append(
                f"{images.name} zero-shot ({metrics['embeddings']} embeddings): top-1 {100 * metrics['acc1']:.2f}%, "
                f"top-{top_k[3:]} {100 * metrics[top_k]:.2f}%, mean per-class recall "
                f"{100 * metrics['mean_per_class_recall']:.2f}% (chance {100 * metrics['chance']:.1f}%)")
        if len(test_sets) > 1:
            name = self.mean_name or "mean"
            mean = tasks.mean_over_test_sets(model, test_sets, output, name)
            result.metrics[name] = mean
            result.lines.append(f"{name} over {len(test_sets)} test sets: top-1 {100 * mean['acc1']:.2f}%")
        return result


@dataclass(frozen=True)
class LinearProbeTask:
    """L-BFGS logistic regression on frozen image features with CLIP's lambda search."""

    name: ClassVar[str] = "linear-probe"
    train_data: str = "captioned"
    train_split: str = "train"
    test_data: str | None = None  # None: train_data
    test_split: str = "test"
    val_data: str | None = None  # None: a random half of train
    val_split: str = "val"
    few_shot: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.few_shot is not None and self.few_shot < 1:
            raise ConfigError(f"--few-shot must be at least 1 image per class, got {self.few_shot}")

    def run(self, model: EvalModel, options: EvalOptions, output: Path) -> EvalResult:
        train = options.images(self.train_data, self.train_split)
        test = options.images(self.test_data or self.train_data, self.test_split)
        if test.identity == train.identity:
            raise ConfigError(f"the linear probe's test images would be its training images ({train.name}): give "
                              "--test-data, or a folder with train/ and test/ inside")
        validation = options.images(self.val_data, self.val_split) if self.val_data else None
        metrics = tasks.linear_probe_task(model, train, test, output, options.encoding, validation=validation,
                                           few_shot=self.few_shot, seed=self.seed)
        searched = metrics["validation_accuracy"]
        line = (f"{test.name} linear probe: top-1 {100 * metrics['lp_acc1']:.2f}% with lambda "
                f"{metrics['lambda_']:.3g} ("
                + (f"validation {100 * searched:.2f}%" if searched is not None else "not searched: see the report")
                + f", {metrics['train_size']} training images)")
        return EvalResult(self.name, output, {test.name: metrics}, [line])


@dataclass(frozen=True)
class _OneSetTask:
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


@dataclass(frozen=True)
class RetrievalTask(_OneSetTask):
    """Image-to-text and text-to-image retrieval; several captions of an image are several right answers."""

    name: ClassVar[str] = "retrieval"

    def measure(self, model: EvalModel, images: ImageSet, options: EvalOptions, output: Path) -> dict[str, Any]:
        return tasks.retrieval(model, images, output, options.encoding)

    def line(self, metrics: dict[str, Any]) -> str:
        return (f"retrieval ({metrics['images']} images, {metrics['captions']} captions): "
                + ", ".join(f"{k} {100 * v:.1f}%" for k, v in metrics.items() if "recall@" in k))


@dataclass(frozen=True)
class DiagnosticsTask(_OneSetTask):
    """The paper's embedding analyses: effective eigenvalues, uniformity, alignment, InfoNCE saturation."""

    name: ClassVar[str] = "diagnostics"

    def measure(self, model: EvalModel, images: ImageSet, options: EvalOptions, output: Path) -> dict[str, Any]:
        return tasks.diagnostics(model, images, output, options.encoding)

    def line(self, metrics: dict[str, Any]) -> str:
        return (f"diagnostics: effective eigenvalues image {metrics['effective_eigenvalues_image']}, text "
                f"{metrics['effective_eigenvalues_text']}; Ajne A_n image {metrics['ajne_image']:.3f}, text "
                f"{metrics['ajne_text']:.3f}; p1 {metrics['positive_probability_p1']:.3f}")


EvalTask = ZeroShotTask | LinearProbeTask | RetrievalTask | DiagnosticsTask
TASKS: dict[str, type[EvalTask]] = {task.name: task for task in (ZeroShotTask, LinearProbeTask, RetrievalTask,
                                                                  DiagnosticsTask)}


@lease.holding("output")
def evaluate(task: EvalTask, source: ModelSource, output: str | Path,
             options: EvalOptions | None = None) -> EvalResult:
    """Load the model, run ``task``, write its results (CLIP_benchmark JSON, metrics.json, plots, report.md)."""
    storage.ensure_folder(output)
    model = load_model(source.model, source.architecture, source.weights, source.device)
    return task.run(model, options or EvalOptions(), Path(output))

