"""Zero-shot classification with a prompt ensemble, as CLIP and the CLOOB paper evaluate (paper §5.1)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def ensemble(prompt_embeddings: Tensor) -> Tensor:
    """``[C, T, d]`` prompt embeddings -> ``[C, d]``: each normalised, averaged per class, re-normalised (CLIP)."""
    mean = torch.nn.functional.normalize(prompt_embeddings, dim=-1).mean(dim=1)
    return torch.nn.functional.normalize(mean, dim=-1)


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
