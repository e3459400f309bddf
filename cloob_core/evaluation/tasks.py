"""The four evaluation tasks as plain functions: a model and image sets in, CLIP_benchmark-style results and plots
out. ``run.py`` wraps them as the `cloob eval TASK` stage."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

import torch

from cloob_core.evaluation import diagnostics as diag
from cloob_core.evaluation.features import Encoding, class_embeddings, image_features, text_features
from cloob_core.evaluation.inputs import EvalModel, ImageSet
from cloob_core.evaluation.linear_probe import accuracy, few_shot_indices, linear_probe
from cloob_core.evaluation.reports import (
    benchmark_record,
    confusion_png,
    per_class_png,
    similarity_png,
    spectra_png,
    write_result,
)
from cloob_core.evaluation.retrieval import distinct_captions, retrieval_metrics
from cloob_core.evaluation.zeroshot import classification_metrics
from cloob_core.io import read_json
from cloob_core.objectives.losses import hopfield_retrieval

log = logging.getLogger(__name__)


def _need(images: ImageSet, *fields: str) -> None:
    missing = [f for f in fields if getattr(images, f) is None]
    if missing:
        hints = {"labels": "a class per image (ImageFolder, shards with a class field, a packaged set)",
                 "classnames": "class names (--classnames FILE)", "templates": "prompt templates (--classnames FILE "
                 "with a 'templates' list)", "captions": "captions (shards, a captions .csv, a packaged set)"}
        raise ValueError(f"{images.name}: this task needs " + "; ".join(hints[f] for f in missing))


def _record(model: EvalModel, images: ImageSet, task: str, metrics: dict[str, Any],
            warnings: list[str] | None = None) -> dict[str, Any]:
    """The result as CLIP_benchmark writes it; ``warnings`` (what makes a figure less than it seems) beside it,
    shown in the report."""
    if images.skipped:  # the figures cover fewer images than the set holds: say so beside them
        metrics["skipped_unreadable"] = images.skipped
    record = benchmark_record(images.name, model.architecture, model.source, task, metrics)
    if warnings:
        record["warnings"] = list(warnings)
    return record


def zeroshot(model: EvalModel, images: ImageSet, output: Path, encoding: Encoding,
             hopfield_beta: float | None = None) -> dict[str, Any]:
    """Prompt-ensemble zero-shot classification. With ``hopfield_beta``, image and class embeddings are first
    retrieved from the memory of the evaluated images' embeddings (U_x against U_y, as in Eq. 5)."""
    _need(images, "labels", "classnames", "templates")
    if len(images.classnames) < 2:
        raise ValueError(f"{images.name} has {len(images.classnames)} class name(s): zero-shot classification ranks "
                         "at least two (with one, every answer is right by construction)")
    features = image_features(model, images, encoding)
    classes = class_embeddings(model, images.classnames, images.templates, encoding)
    if hopfield_beta is not None:
        features, classes = (hopfield_retrieval(features, features, hopfield_beta),
                             hopfield_retrieval(classes, features, hopfield_beta))
    metrics = classification_metrics(features @ classes.T, torch.tensor(images.labels), len(images.classnames))
    metrics["embeddings"] = "hopfield" if hopfield_beta is not None else "raw"
    metrics["classnames"] = list(images.classnames)  # the order of per_class_accuracy and the confusion matrix
    output.mkdir(parents=True, exist_ok=True)
    task = "zeroshot_classification"
    plots = [
        per_class_png(output / f"{images.name}_{task}_per_class.png", images.classnames,
                      metrics["per_class_accuracy"], metrics["chance"], f"{images.name}: zero-shot per class"),
        confusion_png(output / f"{images.name}_{task}_confusion.png", metrics["confusion_matrix"],
                      images.classnames, f"{images.name}: zero-shot confusion"),
    ]
    write_result(output, _record(model, images, task, metrics), plots)
    return metrics


def mean_over_test_sets(model: EvalModel, test_sets: list[ImageSet], output: Path, name: str) -> dict[str, Any]:
    """The paper's figure for data sets with several test sets: each set's zero-shot metrics and their mean."""
    task = "zeroshot_classification"
    per_set = {images.name: read_json(output / f"{images.name}_{task}.json")["metrics"]
               for images in test_sets}
    keys = [key for key in next(iter(per_set.values()))
            if (key.startswith("acc") or key == "mean_per_class_recall") and all(key in m for m in per_set.values())]
    metrics: dict[str, Any] = {key: statistics.fmean(m[key] for m in per_set.values()) for key in keys}
    metrics["test_sets"] = {set_name: {k: m[k] for k in keys if k in m} for set_name, m in per_set.items()}
    write_result(output, benchmark_record(name, model.architecture, model.source, task, metrics))
    return metrics


def linear_probe_task(model: EvalModel, train: ImageSet, test: ImageSet, output: Path, encoding: Encoding, *,
                       validation: ImageSet | None = None, few_shot: int | None = None,
                       seed: int = 0) -> dict[str, Any]:
    """CLIP's linear probe; its accuracies under CLIP_benchmark's names (``lp_acc1``, ``lp_acc5``,
    ``lp_mean_per_class_recall``), the other figures as zero-shot classification names them."""
    for images in (train, test, *( [validation] if validation else [])):
        _need(images, "labels")
    num_classes = max(max(train.labels), max(test.labels)) + 1
    train_x = image_features(model, train, encoding)
    train_y = torch.tensor(train.labels)
    if few_shot:
        keep = few_shot_indices(train_y, few_shot, torch.Generator().manual_seed(seed))
        train_x, train_y = train_x[keep], train_y[keep]
    test_x, test_y = image_features(model, test, encoding), torch.tensor(test.labels)
    val_x = val_y = None
    if validation is not None:
        val_x, val_y = image_features(model, validation, encoding), torch.tensor(validation.labels)
    fit, search = linear_probe(train_x, train_y, num_classes, val_x=val_x, val_y=val_y, seed=seed)
    scores = fit.predict_scores(test_x)
    metrics = {f"lp_{key}" if key.startswith("acc") or key == "mean_per_class_recall" else key: value
               for key, value in classification_metrics(scores, test_y, num_classes).items()}
    metrics.update(lambda_=search.lam, validation_accuracy=search.validation_accuracy,
                   lambda_search={f"{k:.3g}": v for k, v in search.tried.items()}, train_size=len(train_y),
                   few_shot=few_shot or 0)
    metrics["lp_acc1_check"] = accuracy(fit, test_x, test_y)
    for warning in search.warnings:
        log.warning("%s linear probe: %s", test.name, warning)
    output.mkdir(parents=True, exist_ok=True)
    names = test.classnames or [str(c) for c in range(num_classes)]
    task = "linear_probe"
    plots = [per_class_png(output / f"{test.name}_{task}_per_class.png", names, metrics["per_class_accuracy"],
                           metrics["chance"], f"{test.name}: linear probe per class (lambda {search.lam:.3g})")]
    write_result(output, _record(model, test, task, metrics, search.warnings), plots)
    return metrics


def caption_pairs(model: EvalModel, images: ImageSet, encoding: Encoding
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Image features, each distinct caption's features, the (caption, image) matches and each image's first
    caption: what retrieval scores and the diagnostics pair up."""
    if images.captions is None and None not in (images.labels, images.classnames, images.templates):
        # a labelled set without captions (an ImageFolder): its class prompt is every image's caption
        images.captions = [[images.templates[0].format(images.classnames[label])] for label in images.labels]
        log.info("%s has no captions: using '%s' with each image's class name", images.name, images.templates[0])
    _need(images, "captions")
    texts, matches, first = distinct_captions(images.captions)
    image_x = image_features(model, images, encoding)
    text_y = text_features(model, texts, encoding, f"captions|{images.identity}")
    return image_x, text_y, matches, first


def retrieval(model: EvalModel, images: ImageSet, output: Path, encoding: Encoding) -> dict[str, Any]:
    image_x, text_y, matches, _ = caption_pairs(model, images, encoding)
    metrics = retrieval_metrics(image_x, text_y, matches)
    metrics.update(images=len(image_x), captions=len(text_y))
    write_result(output, _record(model, images, "zeroshot_retrieval", metrics))
    return metrics


def matched_features(model: EvalModel, images: ImageSet, encoding: Encoding) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's features and its first caption's: the matched pairs the diagnostics analyse."""
    image_x, text_y, _, first = caption_pairs(model, images, encoding)
    return image_x, text_y[torch.tensor(first)]


def diagnostics(model: EvalModel, images: ImageSet, output: Path, encoding: Encoding,
                top_k: int = 10) -> dict[str, Any]:
    """The paper's embedding analyses on matched image-caption pairs (the first caption of each image)."""
    found = diag.embedding_diagnostics(*matched_features(model, images, encoding), model.inv_tau, top_k)
    metrics, spectra = found.metrics, found.spectra
    output.mkdir(parents=True, exist_ok=True)
    task = "diagnostics"
    plots = [
        spectra_png(output / f"{images.name}_{task}_eigen_spectra.png", {k: v.numpy() for k, v in spectra.items()},
                    found.effective, f"{images.name}: covariance eigen-spectra"),
        similarity_png(output / f"{images.name}_{task}_similarities.png", found.matched.numpy(),
                       found.unmatched.numpy(), top_k,
                       f"{images.name}: matched vs top-{top_k} unmatched"),
    ]
    write_result(output, _record(model, images, task, metrics), plots)
    return metrics


