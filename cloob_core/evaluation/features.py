"""Embeddings of an image set (and its captions or class prompts), computed once and cached on disk.

The cache key covers the weights (their hash), the data set's identity, the preprocessing and what is
embedded, so a retrained model or other data never reuses stale features. Cache files are plain tensors, read
with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from cloob_core.evaluation.inputs import EvalModel, ImageSet
from cloob_core.io import UnreadableFile, read_torch, write_torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Encoding:
    """How features are computed: the cache folder (None: none), images per batch, progress bars, and a folder
    of features computed ahead that is only read (a Kubeflow step's input artifact, shared by a data set's tasks)."""

    cache: Path | None = None
    batch_size: int = 256
    progress: bool = True
    shared: Path | None = None


class _Images(torch.utils.data.Dataset):
    def __init__(self, images: ImageSet, transform):
        self.images, self.transform = images, transform

    def __len__(self) -> int:
        return self.images.size

    def __getitem__(self, index: int) -> Tensor:
        return self.transform(self.images.opener(index))


def _read_cached(path: Path) -> Tensor | None:
    if not path.exists():
        return None
    try:
        cached = read_torch(path, str(path))
    except UnreadableFile as err:  # a damaged cache entry is computed again, not fatal
        log.warning("%s; computing it again", err)
        return None
    log.debug("features from cache %s", path)
    return cached


def _cached(encoding: Encoding, key: str, compute) -> Tensor:
    name = f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"
    for folder in (encoding.shared, encoding.cache):
        found = _read_cached(folder / name) if folder is not None else None
        if found is not None:
            return found
    value = compute()
    if encoding.cache is not None:
        write_torch(encoding.cache / name, value)
    return value


def image_features(model: EvalModel, images: ImageSet, encoding: Encoding) -> Tensor:
    def compute() -> Tensor:
        loader = torch.utils.data.DataLoader(_Images(images, model.transform), batch_size=encoding.batch_size)
        device = next(model.model.parameters()).device
        out = [model.encode_images(batch.to(device)).cpu()
               for batch in tqdm(loader, desc=f"embed {images.name}", unit="batch", disable=not encoding.progress)]
        return torch.cat(out)

    return _cached(encoding, f"images|{model.fingerprint}|{images.identity}|{model.transform}", compute)


def text_features(model: EvalModel, texts: Sequence[str], encoding: Encoding, tag: str) -> Tensor:
    def compute() -> Tensor:
        device = next(model.model.parameters()).device
        step = 2 * encoding.batch_size  # texts are cheaper to encode than images
        chunks = [texts[i : i + step] for i in range(0, len(texts), step)]
        return torch.cat([model.encode_texts(model.tokenizer(list(chunk)).to(device)).cpu() for chunk in chunks])

    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    return _cached(encoding, f"texts|{model.fingerprint}|{tag}|{digest}", compute)
