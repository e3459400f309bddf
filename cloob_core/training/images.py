"""Training images: encoded bytes to uint8 crops at the model's input size, normalised per batch on the device.

The meaning is open_clip's transforms: for training ``RandomResizedCrop(size, scale=(0.9, 1.0))`` (open_clip's
``AugmentationCfg``, torchvision's aspect ratios 3/4 to 4/3), bicubic, RGB; with ``train.augment`` off its
evaluation one (the shorter side to ``size``, a centre crop); then the model's mean and std. What differs is the
cost, which at a small input size is per-sample overhead rather than pixels (docs/performance.md, "The training
stage"), so three things are done here instead of by the torchvision transform:

- a JPEG decodes at the smallest DCT scale (1/8, 1/4, 1/2 or 1) whose image still holds the smallest crop the
  augmentation can draw at the output size, by the download stage's own decode path (``data.decoding``): the
  crop is drawn in relative terms, so its scale and aspect are unchanged;
- the crop is drawn by torchvision's algorithm (ten tries, then a centre crop) on Python floats from a generator
  seeded per chunk, instead of a dozen one-element torch tensors per try;
- ToTensor and Normalize run once per batch, on the device: uint8 is a quarter of the bytes through the
  data-loader's pipe and the host-to-device copy, and the batch is built channels-last (pixel-major, as PIL
  gives it) with one copy.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass, field

import numpy as np
import open_clip
import torch
from PIL import Image

from cloob_core.data.decoding import decode_reduced
from cloob_core.model.dual_encoder import image_stats

TRIES = 10  # torchvision's RandomResizedCrop: random draws before the centre-crop fallback
RATIO = (3 / 4, 4 / 3)  # torchvision's default aspect ratios, which open_clip's training transform keeps


@dataclass(frozen=True)
class TrainImages:
    size: int  # the model's square input
    augment: bool = True
    scale: tuple[float, float] = tuple(open_clip.AugmentationCfg().scale)  # type: ignore[assignment]
    ratio: tuple[float, float] = RATIO

    def decode(self, data: bytes) -> Image.Image:
        """The RGB image, decoded no larger than its smallest crop needs."""
        image = Image.open(io.BytesIO(data))
        decode_reduced(image, *self._needed(*image.size))
        return image.convert("RGB")

    def crop(self, image: Image.Image, rng: random.Random) -> np.ndarray:
        """One view: [size, size, 3] uint8 (read-only; the batch ring copies it once, into the batch)."""
        left, top, width, height = self._box(*image.size, rng)
        view = image.crop((left, top, left + width, top + height)).resize((self.size, self.size),
                                                                        Image.Resampling.BICUBIC)
        return np.asarray(view)

    def _box(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        if not self.augment:  # open_clip's evaluation transform: shorter side to size, centre crop
            side = min(width, height)
            return (width - side) // 2, (height - side) // 2, side, side
        area, log_ratio = width * height, (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(TRIES):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, width - w), rng.randint(0, height - h), w, h
        w, h = self._fallback(width, height)
        return (width - w) // 2, (height - h) // 2, w, h

    def _fallback(self, width: int, height: int) -> tuple[int, int]:
        if width / height < self.ratio[0]:
            return width, round(width / self.ratio[0])
        if width / height > self.ratio[1]:
            return round(height * self.ratio[1]), height
        return width, height

    def _needed(self, width: int, height: int) -> tuple[int, int]:
        """The decoded size at which the smallest crop this image can get still covers ``size`` x ``size``."""
        if self.augment:
            fallback = self._fallback(width, height)
            area = width * height
            least_w = min(width, fallback[0], math.sqrt(self.scale[0] * area * self.ratio[0]))
            least_h = min(height, fallback[1], math.sqrt(self.scale[0] * area / self.ratio[1]))
        else:
            least_w = least_h = min(width, height)
        side = self.size + 1  # a pixel of slack for the crop's rounding
        return math.ceil(width * side / max(least_w, 1)), math.ceil(height * side / max(least_h, 1))


@dataclass(frozen=True)
class Normalize:
    """uint8 [N, 3, H, W] to the model's input: x / 255, minus the mean, over the std (per channel). The
    constants are made once per device: built on every call, they cost two blocking host-to-device copies a step."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    _on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False,
                                                                       repr=False)

    @classmethod
    def of(cls, visual: torch.nn.Module) -> Normalize:
        return cls(*image_stats(visual))

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.device not in self._on:
            mean = torch.tensor(self.mean).view(1, -1, 1, 1) * 255
            scale = 1 / (torch.tensor(self.std).view(1, -1, 1, 1) * 255)
            self._on[images.device] = (mean.to(images.device), scale.to(images.device))
        mean, scale = self._on[images.device]
        return images.to(torch.float32, copy=True).sub_(mean).mul_(scale)  # a copy even of float input
