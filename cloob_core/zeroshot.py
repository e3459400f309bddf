"""Zero-shot classification with a prompt ensemble, as CLIP and the CLOOB paper evaluate (paper §5.1)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

Tokenizer = Callable[[Sequence[str]], Tensor]


@torch.no_grad()
def class_embeddings(
    encode_text: Callable[[Tensor], Tensor],
    tokenizer: Tokenizer,
    classnames: Sequence[str],
    templates: Sequence[str],
) -> Tensor:
    """``[C, d]`` class embeddings: each prompt embedding normalised, averaged per class, re-normalised."""
    if not classnames or not templates:
        raise ValueError("zero-shot classification needs at least one class name and one template")
    rows = []
    for name in classnames:
        prompts = encode_text(tokenizer([template.format(name) for template in templates]))
        prompts = prompts / prompts.norm(dim=-1, keepdim=True)
        mean = prompts.mean(dim=0)
        rows.append(mean / mean.norm())
    return torch.stack(rows)


def classification_metrics(scores: Tensor, labels: Tensor, num_classes: int) -> dict[str, object]:
    """Top-1, top-k (k = min(5, C)), mean per-class recall and per-class accuracy from ``[N, C]`` scores."""
    labels = labels.to(scores.device)
    k = min(5, num_classes)
    topk = scores.topk(k, dim=-1).indices
    predicted = topk[:, 0]
    per_class = []
    for c in range(num_classes):
        members = labels == c
        per_class.append(float((predicted[members] == c).float().mean()) if members.any() else float("nan"))
    recalls = np.array(per_class)
    return {
        "top1": float((predicted == labels).float().mean()),
        f"top{k}": float((topk == labels[:, None]).any(dim=-1).float().mean()),
        "mean_per_class_recall": float(np.nanmean(recalls)),
        "per_class_accuracy": per_class,
        "chance": 1.0 / num_classes,
    }
