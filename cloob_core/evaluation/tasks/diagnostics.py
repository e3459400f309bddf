"""The paper's analyses of the embedding spaces (CLOOB §3-§5, App. A.2.7): why CLOOB's embeddings differ.

- effective number of eigenvalues: how many of the sorted covariance eigenvalues carry 99% of the variance
  (more = richer covariance structure, which Hopfield retrieval amplifies);
- Ajne's A_n uniformity statistic (App. Eq. A177): ``n/4 - 1/(pi n) sum_{i<j} arccos(x_i . x_j)``; about 1/4 for
  uniformly spread embeddings, n/4 for collapsed ones;
- alignment of matched pairs (mean cosine, and Wang & Isola's mean squared distance);
- cosine similarity of matched pairs vs the top-k unmatched pairs per anchor (App. Fig. A2);
- InfoNCE saturation: the mean softmax probability p1 of the positive (paper §4: InfoNCE saturates as p1 -> 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from cloob_core.evaluation.features import Encoding
from cloob_core.evaluation.figures import similarity_png, spectra_png
from cloob_core.evaluation.inputs import ImageSet
from cloob_core.evaluation.records import write_result
from cloob_core.evaluation.tasks.common import EvalOptions, OneSetTask, task_record
from cloob_core.evaluation.tasks.retrieval import CaptionPairs, caption_pairs
from cloob_core.model.source import EvalModel


@torch.no_grad()
def eigen_spectrum(embeddings: Tensor) -> Tensor:
    """Eigenvalues of the embeddings' covariance, largest first (float64)."""
    x = embeddings.double()
    x = x - x.mean(dim=0, keepdim=True)
    covariance = x.T @ x / max(x.shape[0] - 1, 1)
    return torch.linalg.eigvalsh(covariance).flip(0).clamp_min(0.0)


def effective_eigenvalues(spectrum: Tensor, share: float = 0.99) -> int:
    """The fewest leading eigenvalues whose sum reaches ``share`` of the total."""
    total = spectrum.sum()
    if total <= 0:
        return 0
    cumulative = spectrum.cumsum(0) / total
    return int(torch.searchsorted(cumulative, torch.tensor(share, dtype=cumulative.dtype) - 1e-12).item()) + 1


@torch.no_grad()
def ajne_statistic(embeddings: Tensor, block: int = 2048) -> float:
    """Ajne's A_n on L2-normalised rows (App. Eq. A177), computed in blocks (no n x n matrix at once)."""
    x = torch.nn.functional.normalize(embeddings.double(), dim=-1)
    n = x.shape[0]
    angle_sum = 0.0
    for start in range(0, n, block):
        rows = x[start : start + block]
        cosines = (rows @ x.T).clamp(-1.0, 1.0)
        angles = torch.arccos(cosines)
        # keep j > i only: columns after each row's own index
        index = torch.arange(start, start + rows.shape[0], device=x.device)[:, None]
        angles = angles.masked_fill(torch.arange(n, device=x.device)[None, :] <= index, 0.0)
        angle_sum += float(angles.sum())
    return n / 4.0 - angle_sum / (math.pi * n)


@torch.no_grad()
def alignment(image_features: Tensor, text_features: Tensor) -> dict[str, float]:
    x = torch.nn.functional.normalize(image_features.double(), dim=-1)
    y = torch.nn.functional.normalize(text_features.double(), dim=-1)
    return {"matched_cosine_mean": float((x * y).sum(dim=-1).mean()),
            "matched_squared_distance_mean": float((x - y).pow(2).sum(dim=-1).mean())}


@torch.no_grad()
def matched_vs_unmatched(image_features: Tensor, text_features: Tensor, top_k: int = 10) -> tuple[Tensor, Tensor]:
    """Cosine of each matched pair, and of each anchor's ``top_k`` most similar unmatched texts."""
    scores = image_features.double() @ text_features.double().T
    matched = scores.diagonal().clone()
    k = min(top_k, scores.shape[1] - 1)
    unmatched = scores.fill_diagonal_(float("-inf")).topk(k, dim=1).values.flatten()
    return matched, unmatched


@torch.no_grad()
def positive_probability(image_features: Tensor, text_features: Tensor, inv_tau: float) -> float:
    """Mean p1 = softmax(inv_tau * x_i . y_j)_ii over anchors, both directions averaged."""
    logits = inv_tau * (image_features.double() @ text_features.double().T)
    image_to_text = logits.softmax(dim=1).diagonal().mean()
    text_to_image = logits.softmax(dim=0).diagonal().mean()
    return float((image_to_text + text_to_image) / 2)


@dataclass(frozen=True)
class EmbeddingDiagnostics:
    """All of the above for one set of matched pairs: the scalars (with the spectra as lists, for JSON), and the
    tensors the plots draw."""

    metrics: dict[str, Any]
    spectra: dict[str, Tensor]
    effective: dict[str, int]
    matched: Tensor
    unmatched: Tensor


@torch.no_grad()
def embedding_diagnostics(image_features: Tensor, text_features: Tensor, inv_tau: float,
                          top_k: int = 10) -> EmbeddingDiagnostics:
    """The paper's analyses of matched pairs (row i of each is one pair): what `cloob eval diagnostics` reports
    for a model and the training trajectory reports at each checkpoint."""
    spectra = {"image": eigen_spectrum(image_features), "text": eigen_spectrum(text_features)}
    effective = {name: effective_eigenvalues(values) for name, values in spectra.items()}
    matched, unmatched = matched_vs_unmatched(image_features, text_features, top_k)
    metrics = {
        "effective_eigenvalues_image": effective["image"],
        "effective_eigenvalues_text": effective["text"],
        "ajne_image": ajne_statistic(image_features),
        "ajne_text": ajne_statistic(text_features),
        **alignment(image_features, text_features),
        "matched_similarity_mean": float(matched.mean()),
        f"top{top_k}_unmatched_similarity_mean": float(unmatched.mean()),
        "positive_probability_p1": positive_probability(image_features, text_features, inv_tau),
        "inv_tau": inv_tau,
        "pairs": len(image_features),
        "spectrum_image": spectra["image"].tolist(),
        "spectrum_text": spectra["text"].tolist(),
    }
    return EmbeddingDiagnostics(metrics, spectra, effective, matched, unmatched)


@dataclass(frozen=True)
class DiagnosticsTask(OneSetTask):
    """The paper's embedding analyses: effective eigenvalues, uniformity, alignment, InfoNCE saturation."""

    name: ClassVar[str] = "diagnostics"

    def measure(self, model: EvalModel, images: ImageSet, options: EvalOptions, output: Path) -> dict[str, Any]:
        return diagnostics(model, images, output, options.encoding)

    def line(self, metrics: dict[str, Any]) -> str:
        return (f"diagnostics: effective eigenvalues image {metrics['effective_eigenvalues_image']}, text "
                f"{metrics['effective_eigenvalues_text']}; Ajne A_n image {metrics['ajne_image']:.3f}, text "
                f"{metrics['ajne_text']:.3f}; p1 {metrics['positive_probability_p1']:.3f}")


def matched_features(pairs: CaptionPairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's features and its first caption's: the matched pairs the diagnostics analyse."""
    return pairs.image, pairs.text[torch.tensor(pairs.first)]


def diagnostics(model: EvalModel, images: ImageSet, output: Path, encoding: Encoding,
                top_k: int = 10) -> dict[str, Any]:
    """The paper's embedding analyses on matched image-caption pairs (the first caption of each image)."""
    pairs = caption_pairs(model, images, encoding)
    found = embedding_diagnostics(*matched_features(pairs), model.inv_tau, top_k)
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
    write_result(output, task_record(model, images, task, metrics, embedded=pairs.embedded), model.fingerprint,
                 plots)
    return metrics
