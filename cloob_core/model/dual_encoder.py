"""The CLOOB/CLIP dual encoder: open_clip's architectures and tokenizer, never any downloaded weights.

The encoder is a plain ``open_clip.CLIP`` so that what we train loads back with
``open_clip.create_model(<architecture>)`` + ``load_state_dict``. open_clip's ``logit_scale`` parameter holds
``ln(inv_tau)``; it is frozen by default because the paper fixes ``inv_tau = 30``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from importlib import resources

import open_clip
import torch
from torch import Tensor, nn

from cloob_core.config import ConfigError, ModelConfig, TrainConfig

# Architectures the paper trains (RN50, RN101, RN50x4 on CC3M/YFCC; ViT-B-32 as in open_clip) and the
# project's own tiny configuration that trains on two CPU cores in minutes.
PAPER_ARCHITECTURES = ("RN50", "RN101", "RN50x4", "ViT-B-32")
PROJECT_ARCHITECTURES = ("cloob-tiny", "cloob-tiny-vit", "cloob-tiny-vit-w256", "cloob-vit-b-32-64px")

INV_TAU_RANGE = (1.0, 100.0)

_configs_registered = False


def register_project_configs() -> None:
    """Make the JSON configs shipped in ``cloob_core/model/configs`` known to open_clip by name."""
    global _configs_registered
    if not _configs_registered:
        open_clip.add_model_config(resources.files("cloob_core.model") / "configs")
        _configs_registered = True


def available_architectures() -> list[str]:
    register_project_configs()
    return [name for name in (*PAPER_ARCHITECTURES, *PROJECT_ARCHITECTURES) if name in open_clip.list_models()]


@contextlib.contextmanager
def without_random_init_warning() -> Iterator[None]:
    """open_clip warns on the root logger that no weights were loaded: we never ask it for any (random init, or
    our own weights loaded right after), so the warning would only mislead."""

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "No pretrained weights loaded" not in record.getMessage()

    root = logging.getLogger()
    dropper = _Drop()
    root.addFilter(dropper)
    try:
        yield
    finally:
        root.removeFilter(dropper)


class CLOOBModel(nn.Module):
    """Dual encoder whose forward returns L2-normalised image and text embeddings plus ``inv_tau``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        register_project_configs()
        if config.architecture not in open_clip.list_models():
            raise ValueError(
                f"unknown architecture {config.architecture!r}; known: {available_architectures()} "
                "(or any open_clip config name)"
            )
        with without_random_init_warning():
            self.encoder: open_clip.CLIP = open_clip.create_model(
                config.architecture, pretrained=None, pretrained_text=False, pretrained_image=False
            )
        self.config = config
        with torch.no_grad():
            self.encoder.logit_scale.fill_(math.log(config.inv_tau))
        self.encoder.logit_scale.requires_grad_(config.learn_inv_tau)

    @property
    def inv_tau(self) -> Tensor:
        """``1 / tau`` as used in the objectives (a tensor, so a learnable one carries gradient)."""
        return self.encoder.logit_scale.exp()

    @torch.no_grad()
    def clamp_inv_tau_(self) -> None:
        """Keep a learnable ``inv_tau`` in [1, 100] after each optimiser step, as open_clip/CLIP do."""
        low, high = INV_TAU_RANGE
        self.encoder.logit_scale.clamp_(math.log(low), math.log(high))

    def encode_image(self, images: Tensor) -> Tensor:
        return self.encoder.encode_image(images, normalize=True)

    def encode_text(self, tokens: Tensor) -> Tensor:
        return self.encoder.encode_text(tokens, normalize=True)

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.encode_image(images), self.encode_text(tokens), self.inv_tau

    @property
    def image_size(self) -> int:
        size = self.encoder.visual.image_size
        return int(size[0] if isinstance(size, tuple | list) else size)


def build_model(config: ModelConfig) -> CLOOBModel:
    return CLOOBModel(config)


def lock_towers(model: CLOOBModel, train: TrainConfig) -> None:
    """Lock the towers ``train.lock_*`` name, through open_clip's own ``lock_image_tower`` / ``lock_text_tower``
    (LiT): their parameters stop requiring gradients, so the optimiser (which takes only those that do) and DDP
    leave them out; normalisation is frozen as open_clip freezes it."""
    if train.lock_image:
        try:
            model.encoder.lock_image_tower(unlocked_groups=train.lock_image_unlocked_groups,
                                           freeze_bn_stats=train.lock_image_freeze_bn_stats)
        except AssertionError as err:  # open_clip's ModifiedResNet: "partial locking not currently supported"
            raise ConfigError(f"train.lock_image_unlocked_groups {train.lock_image_unlocked_groups}: the image tower "
                              f"of {model.config.architecture} locks only whole ({err}); set it to 0, or pick a ViT "
                              "architecture") from None
    if train.lock_text:
        model.encoder.lock_text_tower(unlocked_layers=train.lock_text_unlocked_layers)


def image_stats(visual: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel mean and std an image tower's config asks for (open_clip's OpenAI values by default)."""
    preprocess = getattr(visual, "preprocess_cfg", {}) or {}
    return (tuple(preprocess.get("mean") or open_clip.OPENAI_DATASET_MEAN),
            tuple(preprocess.get("std") or open_clip.OPENAI_DATASET_STD))


def build_tokenizer(architecture: str):
    """open_clip's tokenizer for ``architecture``; its BPE vocabulary ships inside the package (offline)."""
    register_project_configs()
    return open_clip.get_tokenizer(architecture)
