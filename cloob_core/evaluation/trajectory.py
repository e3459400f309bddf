"""The embedding spaces over training (CLOOB §3, Fig. 2; appendix A.2.7, Fig. A1): the paper's diagnostics at every
checkpoint of a run, so that the effective eigenvalues, uniformity and InfoNCE saturation are followed as learning
proceeds instead of read once at the end. The paper's claim is about the change: modern Hopfield networks raise the
number of effective eigenvalues during learning, relative to a reference point."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core import lease, storage
from cloob_core.evaluation.features import Encoding
from cloob_core.evaluation.inputs import ImageSet, load_images
from cloob_core.evaluation.kept import KeptInputs
from cloob_core.evaluation.tasks.diagnostics import embedding_diagnostics, matched_features
from cloob_core.evaluation.tasks.retrieval import caption_pairs
from cloob_core.io import write_json
from cloob_core.model.source import model_from_checkpoint
from cloob_core.training.checkpoint import complete


@dataclass(frozen=True)
class TrajectoryPoint:
    step: int
    metrics: dict[str, Any]  # what `cloob eval diagnostics` reports, spectra included


def run_checkpoints(run: str) -> list[str]:
    """A run's complete checkpoints (``RUN/checkpoints``, local or s3://), in step order."""
    folder = storage.join(run, "checkpoints")
    found = [storage.join(folder, name) for name in complete(folder)]
    if not found:
        raise FileNotFoundError(f"{folder} holds no complete checkpoints; train with train.keep_checkpoints large "
                                "enough to keep them")
    return found


def diagnostics_over_training(checkpoints: list[str], images: ImageSet, encoding: Encoding,
                              device: str = "auto", precision: str = "auto") -> list[TrajectoryPoint]:
    """The diagnostics of ``images``' matched pairs (each image with its first caption) under each checkpoint:
    the pairs `cloob eval diagnostics` analyses."""
    points = []
    for path in checkpoints:
        model, step = model_from_checkpoint(path, device, precision)
        found = embedding_diagnostics(*matched_features(caption_pairs(model, images, encoding)), model.inv_tau)
        points.append(TrajectoryPoint(step, found.metrics))
    return points


def relative_change(points: list[TrajectoryPoint], key: str, reference_step: int) -> list[tuple[int, float]]:
    """(step, value / value at ``reference_step`` - 1) for a scalar ``key``: the paper's Fig. 2 measure."""
    by_step = {point.step: point.metrics[key] for point in points}
    if reference_step not in by_step:
        raise ValueError(f"no checkpoint at the reference step {reference_step}; steps: {sorted(by_step)}")
    reference = by_step[reference_step]
    if not reference:
        raise ValueError(f"{key} is 0 at the reference step {reference_step}: no relative change")
    return [(step, value / reference - 1.0) for step, value in sorted(by_step.items())]


@dataclass(frozen=True)
class TrajectoryResult:
    points: list[TrajectoryPoint]
    file: Path  # trajectory.json: the data set, the run and every point's metrics
    lines: list[str]


@lease.holding("output")
def evaluate_trajectory(run: str, data: str, split: str, output: str | Path, *, device: str = "auto",
                        precision: str = "auto", workers: int | None = None,
                        progress: bool = True) -> TrajectoryResult:
    """`cloob eval trajectory`: the diagnostics of ``data``'s ``split`` at every checkpoint of ``run``, into
    ``output/trajectory.json``."""
    images = load_images(data, split)
    encoding = Encoding(progress=progress, workers=workers, kept=KeptInputs())  # the same images at every step
    points = diagnostics_over_training(run_checkpoints(run), images, encoding, device, precision)
    file = write_json(Path(output) / "trajectory.json", {
        "run": run, "data": images.name, "points": [{"step": p.step, **p.metrics} for p in points]})
    lines = [f"step {p.step}: effective eigenvalues image {p.metrics['effective_eigenvalues_image']} text "
             f"{p.metrics['effective_eigenvalues_text']}, Ajne A_n image {p.metrics['ajne_image']:.3f} text "
             f"{p.metrics['ajne_text']:.3f}, InfoNCE p1 {p.metrics['positive_probability_p1']:.3f}" for p in points]
    return TrajectoryResult(points, file, lines)
