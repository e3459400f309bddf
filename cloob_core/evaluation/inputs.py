"""What an evaluation runs on: a model (our export, or any open_clip config with a local weights file) and
labelled or captioned images (the embedded held-out split, an ImageFolder tree, WebDataset shards, or a CSV of
image paths and captions)."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import open_clip
import torch
from PIL import Image
from torch import Tensor

from cloob_core import storage
from cloob_core.config import ConfigError
from cloob_core.io import read_torch
from cloob_core.model.dual_encoder import register_project_configs, without_random_init_warning
from cloob_core.model.export import INFO_FILE, load_exported, load_weights

log = logging.getLogger(__name__)
_CLASS_SETS = resources.files("cloob_core.evaluation") / "classnames"  # the paper's data sets


@dataclass
class EvalModel:
    model: open_clip.CLIP
    tokenizer: Callable[[Sequence[str]], Tensor]
    transform: Callable[[Image.Image], Tensor]
    architecture: str
    source: str  # what CLIP_benchmark calls "pretrained": where the weights came from
    fingerprint: str  # identifies the weights, for feature caches
    inv_tau: float

    @torch.no_grad()
    def encode_images(self, images: Tensor) -> Tensor:
        return self.model.encode_image(images, normalize=True).float()

    @torch.no_grad()
    def encode_texts(self, tokens: Tensor) -> Tensor:
        return self.model.encode_text(tokens, normalize=True).float()


def _fingerprint(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def _local_copy(location: str, scratch: Path) -> Path:
    """An exported model folder on S3 is fetched into ``scratch``; a local one is used in place."""
    if not storage.is_s3(location):
        return Path(location)
    storage.download_tree(location, scratch)
    return scratch


def load_model(model: str | None = None, architecture: str | None = None, weights: str | None = None,
               device: str = "cpu") -> EvalModel:
    """``model``: a `cloob train` export (local or s3://). Or ``architecture`` + ``weights``: an open_clip config
    name and a state-dict file (read with weights_only=True)."""
    register_project_configs()
    torch_device = _device(device)
    if architecture and architecture not in open_clip.list_models():
        raise ConfigError(f"unknown architecture {architecture!r}: not one of open_clip's configurations or ours "
                          "(cloob_core/model/configs)")
    if model:
        with tempfile.TemporaryDirectory() as scratch:
            folder = _local_copy(model, Path(scratch))
            if not (folder / INFO_FILE).exists():
                raise FileNotFoundError(f"{model} is not a `cloob train` model folder (no {INFO_FILE})")
            net, info = load_exported(folder)
            fingerprint = _fingerprint(folder / info["state_dict"])
        architecture, inv_tau, source = info["architecture"], float(info["inv_tau"]), model
    elif architecture and weights:
        with without_random_init_warning():  # the weights are loaded next
            net = open_clip.create_model(architecture, pretrained=None)
        load_weights(net, read_torch(weights, weights), weights)
        fingerprint, source = _fingerprint(Path(weights)), weights
        inv_tau = float(net.logit_scale.detach().exp())
    else:
        raise ValueError("give --model (a `cloob train` export) or --architecture with --weights")
    net = net.to(torch_device).eval()
    preprocess = getattr(net.visual, "preprocess_cfg", {}) or {}
    size = net.visual.image_size
    transform = open_clip.image_transform(size if isinstance(size, int) else size[0], is_train=False,
                                          mean=preprocess.get("mean"), std=preprocess.get("std"))
    return EvalModel(model=net, tokenizer=open_clip.get_tokenizer(architecture), transform=transform,
                     architecture=architecture, source=source, fingerprint=fingerprint, inv_tau=inv_tau)


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"--device {name}: no such CUDA device is visible")
    return device


@dataclass
class ImageSet:
    """Images (opened lazily) with labels and/or captions; ``identity`` names it for caches and reports."""

    name: str
    identity: str
    opener: Callable[[int], Image.Image]
    size: int
    labels: list[int] | None = None
    classnames: list[str] | None = None
    captions: list[list[str]] | None = None  # one list of captions per image
    templates: list[str] | None = None
    skipped: int = 0  # unreadable samples left out when the set was read


def packaged_class_sets() -> list[str]:
    """Names of the class-name/template sets shipped in ``cloob_core/evaluation/classnames`` (the paper's data sets)."""
    return sorted(p.name.removesuffix(".json") for p in _CLASS_SETS.iterdir()
                  if p.name.endswith(".json"))


def read_class_file(path: str | None) -> tuple[list[str] | None, list[str] | None]:
    """A JSON file ``{"classnames": [...], "templates": ["a photo of a {c}.", ...]}`` (either key optional), or
    the name of a packaged set (``cifar10``, ``imagenet``, ...; see :func:`packaged_class_sets`)."""
    if not path:
        return None, None
    if not storage.is_s3(path) and not Path(path).exists() and path in packaged_class_sets():
        text = (_CLASS_SETS / f"{path}.json").read_text()
    else:
        try:
            text = storage.read_bytes(path).decode("utf-8")
        except FileNotFoundError:
            raise ConfigError(f"--classnames {path}: no such file, and not a packaged set "
                              f"({', '.join(packaged_class_sets())})") from None
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"--classnames {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--classnames {path} must hold an object with 'classnames' and/or 'templates'")
    names, templates = data.get("classnames"), data.get("templates")
    for key, value in (("classnames", names), ("templates", templates)):
        if value is not None and (not isinstance(value, list) or not value
                                  or not all(isinstance(item, str) and item.strip() for item in value)):
            raise ConfigError(f"--classnames {path}: {key!r} must be a non-empty list of strings, got "
                              f"{str(value)[:80]!r}")
    if templates is not None:
        blind = [t for t in templates if "{c}" not in t and "{}" not in t]
        if blind:
            raise ConfigError(f"--classnames {path}: template {blind[0]!r} has no {{c}} for the class name, so every "
                              "class would get the same prompt")
        templates = [t.replace("{c}", "{}") for t in templates]
    return names, templates


def embedded_set(split: str) -> ImageSet:
    from cloob_core.data.embedded import ZERO_SHOT_TEMPLATES, load_embedded

    data = load_embedded(split)
    return ImageSet(
        name=f"embedded-mnist-{split}", identity=f"embedded:{split}",
        opener=lambda i: Image.fromarray(data.images[i], mode="L").convert("RGB"), size=len(data),
        labels=[int(v) for v in data.labels], classnames=list(data.classnames),
        captions=[[c] for c in data.captions], templates=list(ZERO_SHOT_TEMPLATES),
    )


def image_folder_set(root: Path, name: str) -> ImageSet:
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(root))
    return ImageSet(name=name, identity=f"folder:{root.resolve()}:{len(folder)}",
                    opener=lambda i: folder.loader(folder.samples[i][0]).convert("RGB"), size=len(folder),
                    labels=[label for _, label in folder.samples], classnames=list(folder.classes))


def shard_set(location: str, label_key: str) -> ImageSet:
    """WebDataset shards from `cloob data`: images, captions, and the class field ``label_key`` of the json."""
    import webdataset as wds

    from cloob_core.data.shard_files import SkipCounter, register_s3, shard_list

    register_s3()
    urls, _ = shard_list(location)
    images, labels, captions, names = [], [], [], {}
    handler = SkipCounter()
    for sample in wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=handler)):
        try:  # a sample that does not decode is left out and counted, as in training
            meta = json.loads(sample["json"]) if "json" in sample else {}
            image = next(sample[key] for key in ("jpg", "jpeg", "png", "webp") if key in sample)
            Image.open(io.BytesIO(image)).load()
            caption = sample["txt"].decode("utf-8") if "txt" in sample else None
            label = int(meta[label_key]) if label_key in meta else None
        except Exception as err:
            handler(err)
            continue
        images.append(image)
        captions.append([caption] if caption is not None else [])
        if label is not None:
            labels.append(label)
            if "classname" in meta:
                names[label] = str(meta["classname"])
    if not images:
        raise ConfigError(f"{location}: no readable sample in {len(urls)} shard(s) ({handler.skipped} skipped)")
    if handler.skipped:
        log.warning("%s: %d unreadable sample(s) or shard(s) skipped", location, handler.skipped)
    classnames = [names[i] for i in sorted(names)] if names and sorted(names) == list(range(len(names))) else None
    return ImageSet(name=Path(location.rstrip("/")).name, identity=f"shards:{location}:{len(images)}",
                    opener=lambda i: Image.open(io.BytesIO(images[i])).convert("RGB"), size=len(images),
                    labels=labels if len(labels) == len(images) else None, classnames=classnames,
                    captions=captions if all(captions) else None, skipped=handler.skipped)


def caption_csv_set(path: Path) -> ImageSet:
    """A CSV with ``image,caption`` rows (paths relative to the CSV); repeated images have several captions."""
    by_image: dict[str, list[str]] = {}
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if not {"image", "caption"} <= set(reader.fieldnames or ()):
            raise ConfigError(f"{path} needs the columns image,caption; it has {reader.fieldnames}")
        for row in reader:
            by_image.setdefault(row["image"], []).append(row["caption"])
    files = list(by_image)
    root = path.parent
    return ImageSet(name=path.stem, identity=f"captions:{path.resolve()}:{len(files)}",
                    opener=lambda i: Image.open(root / files[i]).convert("RGB"), size=len(files),
                    captions=[by_image[f] for f in files])


def load_images(source: str, split: str = "test", label_key: str = "label", class_file: str | None = None) -> ImageSet:
    """``embedded`` (split train/test), a folder (ImageFolder; ``SPLIT/`` inside it if present), shards (a folder
    with sizes.json, .tar, brace pattern, s3://), or a .csv of image paths and captions."""
    if source == "embedded":
        images = embedded_set(split)
    elif source.endswith(".csv"):
        images = caption_csv_set(Path(source))
    elif storage.is_s3(source) or source.endswith(".tar") or "{" in source or (Path(source) / "sizes.json").exists():
        images = shard_set(source, label_key)
    elif Path(source).is_dir():
        top = Path(source).resolve()
        if (top / split).is_dir():  # results are named after the data set, with the split: digits-test
            images = image_folder_set(top / split, f"{top.name}-{split}")
        else:
            images = image_folder_set(top, top.name)
    else:
        raise FileNotFoundError(f"{source}: not 'embedded', an image folder, shards or a captions .csv")
    names, templates = read_class_file(class_file)
    if names is not None:
        if images.labels is not None and max(images.labels) >= len(names):
            raise ValueError(f"{class_file} lists {len(names)} class names, the data has label {max(images.labels)}")
        images.classnames = names
    if templates is not None:
        images.templates = templates
    return images
