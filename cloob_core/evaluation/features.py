"""Embeddings of an image set (and its captions or class prompts), computed once and cached on disk.

The cache key covers the weights (their hash), the data set's identity, the preprocessing and what is
embedded, so a retrained model or other data never reuses stale features. Cache files are plain tensors, read
with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from cloob_core.evaluation.inputs import EvalModel, ImageSet
from cloob_core.evaluation.zeroshot import ensemble
from cloob_core.io import UnreadableFile, read_torch, write_torch

log = logging.getLogger(__name__)


class _Images(torch.utils.data.Dataset):
    def __init__(self, images: ImageSet, transform):
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return self.images.size

    def __getitem__(self, index: int) -> Tensor:
        return self.transform(self.images.opener(index))


def _cached(cache_dir: Path | None, key: str, compute) -> Tensor:
    if cache_dir is None:
        return compute()
    path = cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    if path.exists():
        try:
            cached = read_torch(path, str(path))
        except UnreadableFile as err:  # a damaged cache entry is computed again, not fatal
            log.warning("%s; computing it again", err)
        else:
            log.info("features from cache %s", path)
            return cached
    value = compute()
    write_torch(path, value)
    return value


def image_features(model: EvalModel, images: ImageSet, cache_dir: Path | None, batch_size: int = 256,
                   workers: int = 0, progress: bool = True) -> Tensor:
    def compute() -> Tensor:
        loader = torch.utils.data.DataLoader(_Images(images, model.transform), batch_size=batch_size,
                                             num_workers=workers)
        device = next(model.model.parameters()).device
        out = [model.encode_images(batch.to(device)).cpu()
               for batch in tqdm(loader, desc=f"embed {images.name}", unit="batch", disable=not progress)]
        return torch.cat(out)

    return _cached(cache_dir, f"images|{model.fingerprint}|{images.identity}|{model.transform}", compute)


def text_features(model: EvalModel, texts: Sequence[str], cache_dir: Path | None, tag: str,
                  batch_size: int = 512) -> Tensor:
    def compute() -> Tensor:
        device = next(model.model.parameters()).device
        chunks = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
        return torch.cat([model.encode_texts(model.tokenizer(list(chunk)).to(device)).cpu() for chunk in chunks])

    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    return _cached(cache_dir, f"texts|{model.fingerprint}|{tag}|{digest}", compute)


def class_embeddings(model: EvalModel, classnames: Sequence[str], templates: Sequence[str],
                     cache_dir: Path | None) -> Tensor:
    """The prompt ensemble of :func:`cloob_core.evaluation.zeroshot.ensemble`, with the prompts' embeddings cached."""
    prompts = [template.format(name) for name in classnames for template in templates]
    embedded = text_features(model, prompts, cache_dir, "prompts").view(len(classnames), len(templates), -1)
    return ensemble(embedded)
