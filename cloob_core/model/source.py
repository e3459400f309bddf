"""A model to evaluate, named by where it is (a `cloob train` export, one of its checkpoints, or an open_clip
architecture with a weights file) and loaded ready to embed: on its device, in eval mode, with the preprocessing
its config asks for, under the precision its device calls for."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import open_clip
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image
from torch import Tensor

from cloob_core import publish, storage
from cloob_core.config import ConfigError
from cloob_core.devices import autocast, choose_device, resolve_precision
from cloob_core.io import UnreadableFile, file_digest
from cloob_core.model.dual_encoder import register_project_configs, without_random_init_warning
from cloob_core.model.export import load_exported, load_weights, read_state_dict
from cloob_core.model.files import INFO_FILE, LOCAL_DIR
from cloob_core.model.starting_weights import HF_HUB, hub_folder, named_weights
from cloob_core.threads import plan_threads

OPEN_CLIP_SCHEMAS = (HF_HUB, LOCAL_DIR)  # a --model that open_clip itself loads


@dataclass
class EvalModel:
    """A loaded model: ``encode_*`` give unit-norm float32 embeddings, computed under ``precision`` (bf16 autocast
    on a GPU by default: docs/evaluation.md, "Device and precision")."""

    model: open_clip.CLIP
    tokenizer: Callable[[Sequence[str]], Tensor]
    transform: Callable[[Image.Image], Tensor]
    architecture: str
    source: str  # what CLIP_benchmark calls "pretrained": where the weights came from
    fingerprint: str  # identifies the weights, for feature caches
    inv_tau: float
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"  # resolved: fp32, bf16 or fp16

    def config_digest(self) -> str | None:
        """The SHA-256 (16 hex digits) of the architecture's open_clip configuration (``model_cfg``), the same for
        every spelling of one model: a folder's ``open_clip_config.json`` or a registered architecture's. None
        where open_clip cannot give it."""
        try:
            config = open_clip.get_model_config(_open_clip_location(self.source) if self.source.startswith(
                OPEN_CLIP_SCHEMAS) else self.architecture)
        except (OSError, ValueError):
            return None
        return None if config is None else hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        with autocast(self.precision, self.device.type):
            return self.model.encode_image(images.to(self.device, non_blocking=True), normalize=True).float()

    @torch.no_grad()
    def encode_texts(self, tokens: Tensor) -> Tensor:
        with autocast(self.precision, self.device.type):
            return self.model.encode_text(tokens.to(self.device, non_blocking=True), normalize=True).float()


@dataclass(frozen=True)
class ModelSource:
    """A `cloob train` export (``model``, local or s3://; or an open_clip ``hf-hub:ORG/NAME`` or ``local-dir:PATH``
    name), a `cloob train` checkpoint (``checkpoint``: the model as it was at that step), or an open_clip
    ``architecture`` with ``weights``; where it runs (``device``: auto, cpu, cuda, cuda:N) and how (``precision``:
    auto, fp32, bf16, fp16)."""

    model: str | None = None
    architecture: str | None = None
    weights: str | None = None
    device: str = "auto"
    checkpoint: str | None = None
    precision: str = "auto"


def load_model(source: ModelSource) -> EvalModel:
    """The model ``source`` names, ready to embed (state dicts read with weights_only=True)."""
    register_project_configs()
    device = choose_device(source.device, setting="--device")
    plan_threads(device_type=device.type).apply()  # the data loader's workers, where there are any, re-plan it
    architecture = source.architecture
    if architecture and architecture not in open_clip.list_models():
        raise ConfigError(f"unknown architecture {architecture!r}: not one of open_clip's configurations or ours "
                          "(cloob_core/model/configs)")
    if source.model and source.model.startswith(OPEN_CLIP_SCHEMAS):
        net, tokenizer, inv_tau = _open_clip_named(_open_clip_location(source.model))
        architecture = name = source.model
        fingerprint = named_weights(source.model, store="", setting="the model")[1][:16]
    elif source.model:
        with tempfile.TemporaryDirectory() as scratch:
            # on S3 fetched into scratch, a local one read in place; checked against a unit published there
            folder = publish.checked_local(source.model, Path(scratch))
            if not (folder / INFO_FILE).exists():
                raise FileNotFoundError(f"{source.model} is not a `cloob train` model folder (no {INFO_FILE})")
            exported = load_exported(folder)  # its tokenizer is read now: the folder may be a scratch copy
            fingerprint = file_digest(exported.weights)[:16]
        net, tokenizer, info = exported.model, exported.tokenizer, exported.info
        architecture, inv_tau, name = info["architecture"], float(info["inv_tau"]), source.model
    elif source.checkpoint:
        return model_from_checkpoint(source.checkpoint, source.device, source.precision)[0]
    elif architecture and source.weights:
        with without_random_init_warning():  # the weights are loaded next
            net = open_clip.create_model(architecture, pretrained=None)
        load_weights(net, read_state_dict(source.weights), source.weights)
        tokenizer = open_clip.get_tokenizer(architecture)
        fingerprint, name = file_digest(source.weights)[:16], source.weights
        inv_tau = float(net.logit_scale.detach().exp())
    else:
        raise ValueError("give --model (a `cloob train` export), --checkpoint (one of its checkpoints) or "
                         "--architecture with --weights")
    return eval_model(net, tokenizer, architecture, name, fingerprint, inv_tau, device, source.precision)


def _open_clip_location(name: str) -> str:
    """What open_clip is given for ``name``: a Hub model as ``local-dir:`` of its cached snapshot (runs read the Hub
    offline), a ``local-dir:`` as it is."""
    return f"{LOCAL_DIR}{hub_folder(name)}" if name.startswith(HF_HUB) else name


def _open_clip_named(name: str) -> tuple[open_clip.CLIP, Callable[[Sequence[str]], Tensor], float]:
    """An open_clip ``hf-hub:`` or ``local-dir:`` model as open_clip loads it (the Hub reached where the network
    allows, its cache otherwise), with its tokenizer and learned temperature."""
    try:
        net = open_clip.create_model(name)
    except (OSError, RuntimeError, ValueError) as err:
        raise FileNotFoundError(f"{name}: open_clip cannot load it ({str(err).splitlines()[0]})") from None
    return net, open_clip.get_tokenizer(name), float(net.logit_scale.detach().exp())


def model_from_checkpoint(location: str, device: str = "auto", precision: str = "auto") -> tuple[EvalModel, int]:
    """The model of a `cloob train` checkpoint (local or s3://; its checksum verified, read with weights_only) and
    its step: a run as it was at that checkpoint."""
    from cloob_core.model.checkpoint_file import CHECKSUM_SUFFIX, load

    register_project_configs()
    saved = load(location)
    try:
        architecture, step, state = saved["config"]["model"]["architecture"], int(saved["step"]), saved["model"]
    except (KeyError, TypeError, ValueError):
        raise UnreadableFile(f"{location} is not a `cloob train` checkpoint (no config, step or model)") from None
    with without_random_init_warning():  # the checkpoint's weights are loaded next
        net = open_clip.create_model(architecture, pretrained=None)
    load_weights(net, {key.removeprefix("encoder."): value for key, value in state.items()}, location)
    fingerprint = storage.read_bytes(location + CHECKSUM_SUFFIX).decode().strip()[:16]
    return eval_model(net, open_clip.get_tokenizer(architecture), architecture, location, fingerprint,
                      float(net.logit_scale.detach().exp()), choose_device(device, setting="--device"),
                      precision), step


PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def eval_model(net: open_clip.CLIP, tokenizer: Callable[[Sequence[str]], Tensor], architecture: str, source: str,
               fingerprint: str, inv_tau: float, device: torch.device, precision: str = "auto") -> EvalModel:
    """``net`` on ``device`` in eval mode, with the preprocessing its config asks for (the transform
    ``open_clip.create_model_and_transforms`` gives for evaluation, from the same config) and ``precision``
    resolved for the device."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    net = net.to(device).eval()
    transform = image_transform_v2(PreprocessCfg(**net.visual.preprocess_cfg), is_train=False)
    return EvalModel(model=net, tokenizer=tokenizer, transform=transform, architecture=architecture, source=source,
                     fingerprint=fingerprint, inv_tau=inv_tau, device=device,
                     precision=resolve_precision(precision, device))
