"""Whether a pool image is a copy of an evaluation image, told from a look-alike by its pixels.

A perceptual hash or an embedding finds candidates, but neither tells a copy from a look-alike: a 64-bit pHash
puts 35% of MNIST's training digits within 6 bits of a test digit, and colour variants of one drawing (a blue eye
and a brown one) share a hash, since pHash reads only luminance (``benchmarks/bench_decontaminate.py``). A copy is
the same picture in the same colours, re-encoded, resized, cropped or given a border; so each candidate pair is
compared by its pixels: the maximum normalised cross-correlation, over the three colour channels together, of the
one image resized into every placement within the other, at scales of 80-100% of its width and height each (a
crop of the evaluation image, or the evaluation image with a border, either way round). A re-encoding scores
about 1.0; a look-alike less (docs/curation.md has the measured figures and the setting's default).

Both images are compared as :data:`SIDE` x :data:`SIDE` views (their aspect set aside: a crop or a border
changes both alike), so that an evaluation image is held as 3 KB while the pool is read.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

SIDE = 32
SCALES = tuple(1.0 - 0.025 * step for step in range(9))  # 100% down to 80% of the other image's width, height
ASPECT_CHANGE = 0.05  # the most a scaled width and height differ (a crop that is not the image's shape)
_FLAT = 1e-2  # a view's spread (of values 0-1) below which it is blank
GREY = 2  # a view whose channels differ by at most this everywhere is grey: compared by its luminance only


def copy_view(image: Image.Image) -> np.ndarray:
    """``image`` as compared: RGB, resized to SIDE x SIDE, uint8 [3, SIDE, SIDE]."""
    resized = image.convert("RGB").resize((SIDE, SIDE), Image.BILINEAR)
    return np.ascontiguousarray(np.asarray(resized, np.uint8).transpose(2, 0, 1))


_LUMINANCE = np.array([0.299, 0.587, 0.114], np.float32).reshape(3, 1, 1)  # ITU-R 601, as PIL's convert("L")


def _is_grey(view: np.ndarray) -> bool:
    channels = view.astype(np.int16)
    return int(np.abs(channels - channels[:1]).max()) <= GREY


@cache
def _scalings() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each scaled size (:data:`SCALES`, :data:`ASPECT_CHANGE`): its resampling matrices, padded to SIDE
    ([K, SIDE, SIDE] for rows and for columns: torch's antialiased bilinear resize, which is separable, of the
    identity), the sizes [K, 2] and the mask of the template's pixels [K, 1, SIDE, SIDE]."""
    sizes = [(max(2, round(SIDE * height)), max(2, round(SIDE * width))) for width in SCALES
             for height in SCALES if abs(height - width) <= ASPECT_CHANGE + 1e-9]
    identity = torch.eye(SIDE, dtype=torch.float32)[None, None]
    rows = torch.zeros((len(sizes), SIDE, SIDE), dtype=torch.float32)
    columns = torch.zeros_like(rows)
    mask = torch.zeros((len(sizes), 1, SIDE, SIDE), dtype=torch.float32)
    for number, (height, width) in enumerate(sizes):
        for matrix, length in ((rows, height), (columns, width)):
            matrix[number, :length] = F.interpolate(identity, size=(length, SIDE), mode="bilinear", antialias=True,
                                                    align_corners=False)[0, 0]
        mask[number, :, :height, :width] = 1.0
    return rows, columns, torch.tensor(sizes), mask


def _window_sums(values: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The sum of ``values`` [SIDE, SIDE] over the window of each of ``sizes`` [K, 2] at every top-left corner,
    [K, SIDE, SIDE] (where the window overhangs, the part inside)."""
    integral = F.pad(values.cumsum(0).cumsum(1), (1, 0, 1, 0))
    start = torch.arange(SIDE)
    top, left = start[None, :, None], start[None, None, :]
    bottom = (top + sizes[:, 0, None, None]).clamp_max(SIDE)
    right = (left + sizes[:, 1, None, None]).clamp_max(SIDE)
    return integral[bottom, right] - integral[top, right] - integral[bottom, left] + integral[top, left]


def _best_placement(inner: torch.Tensor, outer: torch.Tensor) -> float:
    """The highest normalised cross-correlation of ``inner`` [3, SIDE, SIDE], scaled to each size, over its
    placements within ``outer``: every size's correlation at every offset in one batched FFT."""
    rows, columns, sizes, mask = _scalings()
    templates = rows[:, None] @ inner[None] @ columns[:, None].transpose(2, 3)  # [K, 3, SIDE, SIDE], zero-padded
    count = 3 * sizes[:, 0] * sizes[:, 1]
    templates = (templates - (templates.sum(dim=(1, 2, 3)) / count)[:, None, None, None]) * mask
    norms = templates.flatten(1).norm(dim=1)
    outer = outer - outer.mean()
    spectrum = (torch.fft.rfft2(outer)[None] * torch.fft.rfft2(templates).conj()).sum(dim=1)
    products = torch.fft.irfft2(spectrum, s=(SIDE, SIDE))  # [K, SIDE, SIDE]: no wrap where a template fits
    total = _window_sums(outer.sum(dim=0), sizes)
    spread = (_window_sums((outer * outer).sum(dim=0), sizes) - total * total / count[:, None, None]).clamp_min(0)
    scores = products / (spread.sqrt().clamp_min(norms[:, None, None] * 1e-2) * norms[:, None, None])
    start = torch.arange(SIDE)
    fits = ((start[None, :, None] <= SIDE - sizes[:, 0, None, None])
            & (start[None, None, :] <= SIDE - sizes[:, 1, None, None]) & (norms > 1e-3)[:, None, None])
    return float(scores.masked_fill(~fits, -1.0).max())


def copy_similarity(pool_view: np.ndarray, evaluation_view: np.ndarray) -> float:
    """How alike two views (:func:`copy_view`) are as one picture: the best normalised cross-correlation of either
    one, scaled to 80-100% of the other's width and height, in any placement within the other; 1.0 is the same
    pixels."""
    views = [view.astype(np.float32) / 255.0 for view in (pool_view, evaluation_view)]
    if all(view.std() < _FLAT for view in views):  # two blank images: the same if of one colour
        return float(np.abs(views[0].mean(axis=(1, 2)) - views[1].mean(axis=(1, 2))).max() < _FLAT)
    if any(_is_grey(view) for view in (pool_view, evaluation_view)):  # a grey copy has no colours to compare
        views = [np.repeat((view * _LUMINANCE).sum(axis=0, keepdims=True), 3, axis=0) for view in views]
    first, second = (torch.from_numpy(view) for view in views)
    return max(_best_placement(first, second), _best_placement(second, first))
