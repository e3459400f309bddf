"""Image-text retrieval with any number of captions per image (COCO/Flickr style, as CLIP_benchmark scores it).

Text -> image ("image retrieval" in CLIP_benchmark's metric names): each caption has one correct image.
Image -> text ("text retrieval"): an image is found at rank r when the best ranked of its captions is at r. A rank
is 1 + the number of candidates scored strictly higher than the correct one, so ties do not penalise.
"""

from __future__ import annotations

import torch
from torch import Tensor

KS = (1, 5, 10)


def _summary(ranks: Tensor, prefix: str) -> dict[str, float]:
    ranks = ranks.double()
    out = {f"{prefix}_recall@{k}": float((ranks <= k).double().mean()) for k in KS}
    out[f"{prefix}_mean_rank"] = float(ranks.mean())
    out[f"{prefix}_median_rank"] = float(ranks.median())
    return out


@torch.no_grad()
def retrieval_metrics(image_features: Tensor, text_features: Tensor, text_to_image: Tensor,
                      block: int = 4096) -> dict[str, float]:
    """``image_features`` [I, d], ``text_features`` [T, d], ``text_to_image`` [T] (the image of each caption)."""
    num_images = image_features.shape[0]
    if text_to_image.shape[0] != text_features.shape[0]:
        raise ValueError("text_to_image needs one image index per caption")
    if int(text_to_image.min()) < 0 or int(text_to_image.max()) >= num_images:
        raise ValueError("text_to_image holds an index outside the images")
    text_ranks = torch.empty(text_features.shape[0], dtype=torch.long)
    best_image_rank = torch.full((num_images,), torch.iinfo(torch.long).max, dtype=torch.long)
    for start in range(0, text_features.shape[0], block):
        texts = text_features[start : start + block]
        targets = text_to_image[start : start + block].to(texts.device)
        scores = texts @ image_features.T  # [t, I]
        correct = scores.gather(1, targets[:, None])
        text_ranks[start : start + block] = (1 + (scores > correct).sum(dim=1)).cpu()
    for start in range(0, num_images, block):
        images = image_features[start : start + block]
        scores = images @ text_features.T  # [i, T]
        owner = text_to_image.to(scores.device)[None, :] == torch.arange(start, start + images.shape[0],
                                                                          device=scores.device)[:, None]
        if not owner.any(dim=1).all():
            raise ValueError("every image needs at least one caption")
        best_correct = scores.masked_fill(~owner, float("-inf")).max(dim=1, keepdim=True).values
        best_image_rank[start : start + images.shape[0]] = (1 + (scores > best_correct).sum(dim=1)).cpu()
    return {**_summary(text_ranks, "image_retrieval"), **_summary(best_image_rank, "text_retrieval")}
