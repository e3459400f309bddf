"""Image-text retrieval with any number of captions per image (COCO/Flickr style, as CLIP_benchmark scores it),
and identical captions merged into one query whose correct images are all the images that carry it.

The match between captions and images is a list of (caption, image) pairs. Text -> image ("image retrieval" in
CLIP_benchmark's metric names): a caption is found at rank r when the best ranked of its images is at r. Image ->
text ("text retrieval"): an image is found at rank r when the best ranked of its captions is at r. A rank is 1 + the
number of non-matching candidates scored strictly higher than that best match, so ties do not penalise. With one
image per caption this is CLIP_benchmark's recall@k; where one caption describes several images (a template, a
stock phrase), any of them is a correct answer rather than all but one being counted as errors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from cloob_core.evaluation.features import Embedded, Encoding, image_features, text_features
from cloob_core.evaluation.inputs import ImageSet, class_prompts
from cloob_core.evaluation.records import write_result
from cloob_core.evaluation.tasks.common import EvalOptions, OneSetTask, need, task_record
from cloob_core.model.source import EvalModel

log = logging.getLogger(__name__)
KS = (1, 5, 10)


def _summary(ranks: Tensor, prefix: str) -> dict[str, float]:
    ranks = ranks.double()
    out = {f"{prefix}_recall@{k}": float((ranks <= k).double().mean()) for k in KS}
    out[f"{prefix}_mean_rank"] = float(ranks.mean())
    out[f"{prefix}_median_rank"] = float(ranks.median())
    return out


def distinct_captions(captions: list[list[str]]) -> tuple[list[str], torch.Tensor, list[int]]:
    """Each distinct caption once (the images that share it are its joint positives), the (caption, image)
    matches, and the index of each image's first caption."""
    if not all(captions):
        raise ValueError("every image needs at least one caption")
    texts: dict[str, int] = {}
    pairs = {(texts.setdefault(caption, len(texts)), image) for image, own in enumerate(captions) for caption in own}
    first = [texts[own[0]] for own in captions]
    return list(texts), torch.tensor(sorted(pairs), dtype=torch.long).reshape(-1, 2), first


def _ranks(queries: Tensor, candidates: Tensor, matches: Tensor, block: int) -> Tensor:
    """For each query row, 1 + the number of non-matching candidates scored above its best matching one;
    ``matches`` [E, 2] holds (query, candidate) pairs."""
    ranks = torch.empty(queries.shape[0], dtype=torch.long)
    for start in range(0, queries.shape[0], block):
        rows = queries[start : start + block]
        scores = rows @ candidates.T  # [q, C]
        inside = (matches[:, 0] >= start) & (matches[:, 0] < start + rows.shape[0])
        match = torch.zeros_like(scores, dtype=torch.bool)
        match[matches[inside, 0] - start, matches[inside, 1]] = True
        best = scores.masked_fill(~match, float("-inf")).max(dim=1, keepdim=True).values
        ranks[start : start + rows.shape[0]] = (1 + ((scores > best) & ~match).sum(dim=1)).cpu()
    return ranks


@torch.no_grad()
def retrieval_metrics(image_features: Tensor, text_features: Tensor, matches: Tensor,
                      block: int = 4096) -> dict[str, float]:
    """``image_features`` [I, d], ``text_features`` [T, d], ``matches`` [E, 2]: the (caption, image) pairs, where
    every caption and every image appears at least once."""
    matches = matches.long().to(image_features.device)
    if matches.ndim != 2 or matches.shape[1] != 2:
        raise ValueError("matches needs one (caption, image) pair per row")
    for column, count, what in ((0, text_features.shape[0], "caption"), (1, image_features.shape[0], "image")):
        if len(matches) and (int(matches[:, column].min()) < 0 or int(matches[:, column].max()) >= count):
            raise ValueError(f"matches holds a {what} index outside the {what}s")
        if torch.bincount(matches[:, column], minlength=count).eq(0).any():
            raise ValueError(f"every {what} needs at least one match")
    text_ranks = _ranks(text_features, image_features, matches, block)
    image_ranks = _ranks(image_features, text_features, matches.flip(1), block)
    return {**_summary(text_ranks, "image_retrieval"), **_summary(image_ranks, "text_retrieval")}


@dataclass(frozen=True)
class RetrievalTask(OneSetTask):
    """Image-to-text and text-to-image retrieval; several captions of an image are several right answers."""

    name: ClassVar[str] = "retrieval"

    def measure(self, model: EvalModel, images: ImageSet, options: EvalOptions, output: Path) -> dict[str, Any]:
        return retrieval(model, images, output, options.encoding)

    def line(self, metrics: dict[str, Any]) -> str:
        return (f"retrieval ({metrics['images']} images, {metrics['captions']} captions): "
                + ", ".join(f"{k} {100 * v:.1f}%" for k, v in metrics.items() if "recall@" in k))


class CaptionPairs(NamedTuple):
    """What retrieval scores and the diagnostics pair up."""

    image: torch.Tensor  # [N, d] image features
    text: torch.Tensor  # [T, d] each distinct caption's features
    matches: torch.Tensor  # the (caption, image) matches
    first: list[int]  # each image's first caption
    embedded: Embedded  # the image set as read
    uncaptioned: int = 0  # images of the set left out: they have no caption


def caption_pairs(model: EvalModel, images: ImageSet, encoding: Encoding) -> CaptionPairs:
    """The set's images and captions embedded, with which caption belongs to which image."""
    embedded = image_features(model, images, encoding)
    captions = embedded.captions
    if captions is None and embedded.labels is not None:
        classnames, templates = class_prompts(images, embedded.labels, embedded.classnames)
        if classnames is not None and templates is not None:
            # a labelled set without captions (an ImageFolder): its class prompt is every image's caption
            captions = [[templates[0].format(classnames[label])] for label in embedded.labels]
            log.info("%s has no captions: using '%s' with each image's class name", images.name, templates[0])
    need(images.name, captions=captions)
    features, uncaptioned = embedded.features, [i for i, own in enumerate(captions) if not own]
    if uncaptioned:  # no right answer to rank: left out of both directions, counted
        log.warning("%s: %d of %d images have no caption (the first: image %d in the set's order): left out of "
                    "retrieval", images.name, len(uncaptioned), len(captions), uncaptioned[0])
        kept = [i for i, own in enumerate(captions) if own]
        features, captions = features[kept], [captions[i] for i in kept]
    texts, matches, first = distinct_captions(captions)
    text_y = text_features(model, texts, encoding, f"captions|{images.identity}")
    return CaptionPairs(features, text_y, matches, first, embedded, len(uncaptioned))


def retrieval(model: EvalModel, images: ImageSet, output: Path, encoding: Encoding) -> dict[str, Any]:
    pairs = caption_pairs(model, images, encoding)
    metrics = retrieval_metrics(pairs.image, pairs.text, pairs.matches)
    metrics.update(images=len(pairs.image), captions=len(pairs.text))
    warnings = []
    if pairs.uncaptioned:
        metrics["uncaptioned_left_out"] = pairs.uncaptioned
        warnings.append(f"{pairs.uncaptioned} image(s) without a caption left out")
    write_result(output, task_record(model, images, "zeroshot_retrieval", metrics, warnings, pairs.embedded),
                 model.fingerprint)
    return metrics
