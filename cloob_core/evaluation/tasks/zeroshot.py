"""Zero-shot classification with a prompt ensemble, as CLIP and the CLOOB paper evaluate (paper §5.1)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from cloob_core import storage
from cloob_core.config import ConfigError
from cloob_core.evaluation.features import Embedded, Encoding, image_features, text_features
from cloob_core.evaluation.figures import confusion_png, per_class_png
from cloob_core.evaluation.inputs import ImageSet, class_prompts
from cloob_core.evaluation.records import benchmark_record, write_result
from cloob_core.evaluation.tasks.common import EvalOptions, EvalResult, need, task_record
from cloob_core.model.source import EvalModel
from cloob_core.objectives.losses import hopfield_retrieval


def ensemble(prompt_embeddings: Tensor) -> Tensor:
    """``[C, T, d]`` prompt embeddings -> ``[C, d]``: each normalised, averaged per class, re-normalised (CLIP)."""
    mean = torch.nn.functional.normalize(prompt_embeddings, dim=-1).mean(dim=1)
    return torch.nn.functional.normalize(mean, dim=-1)


def class_embeddings(model: EvalModel, classnames: Sequence[str], templates: Sequence[str],
                     encoding: Encoding) -> Tensor:
    """The prompt ensemble of :func:`ensemble`, with the prompts' embeddings cached."""
    prompts = [template.format(name) for name in classnames for template in templates]
    embedded = text_features(model, prompts, encoding, "prompts").view(len(classnames), len(templates), -1)
    return ensemble(embedded)


def classification_metrics(scores: Tensor, labels: Tensor, num_classes: int) -> dict[str, object]:
    """Accuracy at 1 and at k = min(5, C), mean per-class recall and per-class accuracy from ``[N, C]`` scores,
    under CLIP_benchmark's names (``acc1``, ``acc5``, ``mean_per_class_recall``) so its tables read ours."""
    labels = labels.to(scores.device)
    k = min(5, num_classes)
    topk = scores.topk(k, dim=-1).indices
    predicted = topk[:, 0]
    per_class = []
    for c in range(num_classes):
        members = labels == c
        per_class.append(float((predicted[members] == c).float().mean()) if members.any() else float("nan"))
    recalls = np.array(per_class)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.long)
    confusion.index_put_((labels.cpu(), predicted.cpu()), torch.ones_like(labels.cpu()), accumulate=True)
    return {
        "acc1": float((predicted == labels).float().mean()),
        "confusion_matrix": confusion.tolist(),  # rows: true class, columns: predicted class
        f"acc{k}": float((topk == labels[:, None]).any(dim=-1).float().mean()),
        "mean_per_class_recall": float(np.nanmean(recalls)),
        "per_class_accuracy": per_class,
        "chance": 1.0 / num_classes,
    }


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
            metrics = zeroshot(model, images, output, options.encoding, self.hopfield_beta)
            top_k = next((key for key in metrics if key.startswith("acc") and key != "acc1"), "acc1")
            result.metrics[images.name] = metrics
            result.lines.append(
                f"{images.name} zero-shot ({metrics['embeddings']} embeddings): top-1 {100 * metrics['acc1']:.2f}%, "
                f"top-{top_k[3:]} {100 * metrics[top_k]:.2f}%, mean per-class recall "
                f"{100 * metrics['mean_per_class_recall']:.2f}% (chance {100 * metrics['chance']:.1f}%)")
        if len(test_sets) > 1:
            name = self.mean_name or "mean"
            mean = mean_over_test_sets(model, test_sets, output, name)
            result.metrics[name] = mean
            result.lines.append(f"{name} over {len(test_sets)} test sets: top-1 {100 * mean['acc1']:.2f}%")
        return result


def zeroshot(model: EvalModel, images: ImageSet, output: Path, encoding: Encoding,
             hopfield_beta: float | None = None) -> dict[str, Any]:
    """Prompt-ensemble zero-shot classification. With ``hopfield_beta``, image and class embeddings are first
    retrieved from the memory of the evaluated images' embeddings (U_x against U_y, as in Eq. 5)."""
    _at_least_two(images.name, images.classnames)  # where the set names its classes: before any image is read
    embedded = image_features(model, images, encoding)
    classnames, templates = ranked_classes(images, embedded)
    features = embedded.features
    classes = class_embeddings(model, classnames, templates, encoding)
    if hopfield_beta is not None:
        features, classes = (hopfield_retrieval(features, features, hopfield_beta),
                             hopfield_retrieval(classes, features, hopfield_beta))
    metrics = classification_metrics(features @ classes.T, torch.tensor(embedded.labels), len(classnames))
    metrics["embeddings"] = "hopfield" if hopfield_beta is not None else "raw"
    metrics["classnames"] = list(classnames)  # the order of per_class_accuracy and the confusion matrix
    metrics["templates"] = list(templates)
    output.mkdir(parents=True, exist_ok=True)
    task = "zeroshot_classification"
    plots = [
        per_class_png(output / f"{images.name}_{task}_per_class.png", classnames,
                      metrics["per_class_accuracy"], metrics["chance"], f"{images.name}: zero-shot per class"),
        confusion_png(output / f"{images.name}_{task}_confusion.png", metrics["confusion_matrix"],
                      classnames, f"{images.name}: zero-shot confusion"),
    ]
    write_result(output, task_record(model, images, task, metrics, embedded=embedded), model.fingerprint,
                 plots)
    return metrics


def _at_least_two(name: str, classnames: Sequence[str] | None) -> None:
    if classnames is not None and len(classnames) < 2:
        raise ValueError(f"{name} has {len(classnames)} class name(s): zero-shot classification ranks at least two "
                         "(with one, every answer is right by construction)")


def ranked_classes(images: ImageSet, embedded: Embedded) -> tuple[list[str], list[str]]:
    """The class names and templates zero-shot ranks ``images``' embedded samples by: there, and at least two."""
    need(images.name, labels=embedded.labels)
    classnames, templates = class_prompts(images, embedded.labels, embedded.classnames)
    need(images.name, classnames=classnames, templates=templates)
    _at_least_two(images.name, classnames)
    return classnames, templates


def mean_over_test_sets(model: EvalModel, test_sets: list[ImageSet], output: Path, name: str) -> dict[str, Any]:
    """The paper's figure for data sets with several test sets: each set's zero-shot metrics and their mean."""
    task = "zeroshot_classification"
    per_set = {images.name: storage.read_json(output / f"{images.name}_{task}.json")["metrics"]
               for images in test_sets}
    keys = [key for key in next(iter(per_set.values()))
            if (key.startswith("acc") or key == "mean_per_class_recall") and all(key in m for m in per_set.values())]
    metrics: dict[str, Any] = {key: statistics.fmean(m[key] for m in per_set.values()) for key in keys}
    metrics["test_sets"] = {set_name: {k: m[k] for k in keys if k in m} for set_name, m in per_set.items()}
    write_result(output, benchmark_record(name, model.architecture, model.source, task, metrics), model.fingerprint)
    return metrics
