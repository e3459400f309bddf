"""What an evaluation runs on: a model (our export, or any open_clip config with a local weights file) and
labelled or captioned images (a packaged set's held-out split, an ImageFolder tree, WebDataset shards, or a CSV
of image paths and captions)."""

from __future__ import annotations

import csv
import io
import json
import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import open_clip
import torch
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image
from torch import Tensor

from cloob_core import publish, storage
from cloob_core.config import PACKAGED_SETS, PACKAGED_SOURCES, ConfigError
from cloob_core.data.manifest import table_file
from cloob_core.evaluation.class_sets import packaged_class_set, packaged_class_sets
from cloob_core.io import UnreadableFile, file_digest
from cloob_core.model.dual_encoder import register_project_configs, without_random_init_warning
from cloob_core.model.export import load_exported, load_weights, read_state_dict
from cloob_core.model.files import INFO_FILE
from cloob_core.threads import plan_threads

log = logging.getLogger(__name__)


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


def _local_copy(location: str, scratch: Path) -> Path:
    """An exported model folder on S3 is fetched into ``scratch``; a local one is used in place."""
    if not storage.is_s3(location):
        return Path(location)
    storage.download_tree(location, scratch)
    return scratch


@dataclass(frozen=True)
class ModelSource:
    """A `cloob train` export (``model``, local or s3://), a `cloob train` checkpoint (``checkpoint``: the model as
    it was at that step), or an open_clip ``architecture`` with ``weights``."""

    model: str | None = None
    architecture: str | None = None
    weights: str | None = None
    device: str = "cpu"
    checkpoint: str | None = None


def load_model(source: ModelSource) -> EvalModel:
    """The model ``source`` names, ready to embed (state dicts read with weights_only=True)."""
    register_project_configs()
    torch_device = device_named(source.device)
    plan_threads(device_type=torch_device.type).apply()  # no workers: every usable core to torch
    architecture = source.architecture
    if architecture and architecture not in open_clip.list_models():
        raise ConfigError(f"unknown architecture {architecture!r}: not one of open_clip's configurations or ours "
                          "(cloob_core/model/configs)")
    if source.model:
        with tempfile.TemporaryDirectory() as scratch:
            folder = _local_copy(source.model, Path(scratch))
            if not (folder / INFO_FILE).exists():
                raise FileNotFoundError(f"{source.model} is not a `cloob train` model folder (no {INFO_FILE})")
            exported = load_exported(folder)  # its tokenizer is read now: the folder may be a scratch copy
            fingerprint = file_digest(exported.weights)[:16]
        net, tokenizer, info = exported.model, exported.tokenizer, exported.info
        architecture, inv_tau, name = info["architecture"], float(info["inv_tau"]), source.model
    elif source.checkpoint:
        return model_from_checkpoint(source.checkpoint, source.device)[0]
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
    return eval_model(net, tokenizer, architecture, name, fingerprint, inv_tau, torch_device)


def model_from_checkpoint(location: str, device: str = "cpu") -> tuple[EvalModel, int]:
    """The model of a `cloob train` checkpoint (local or s3://; its checksum verified, read with weights_only) and
    its step: a run as it was at that checkpoint."""
    from cloob_core.training.checkpoint_file import CHECKSUM_SUFFIX, load

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
                      float(net.logit_scale.detach().exp()), device_named(device)), step


def eval_model(net: open_clip.CLIP, tokenizer: Callable[[Sequence[str]], Tensor], architecture: str, source: str,
               fingerprint: str, inv_tau: float, device: torch.device) -> EvalModel:
    """``net`` on ``device`` in eval mode, with the preprocessing its config asks for: the transform
    ``open_clip.create_model_and_transforms`` gives for evaluation, from the same config."""
    net = net.to(device).eval()
    transform = image_transform_v2(PreprocessCfg(**net.visual.preprocess_cfg), is_train=False)
    return EvalModel(model=net, tokenizer=tokenizer, transform=transform, architecture=architecture, source=source,
                     fingerprint=fingerprint, inv_tau=inv_tau)


def device_named(name: str) -> torch.device:
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


def read_class_file(path: str | None) -> tuple[list[str] | None, list[str] | None]:
    """A JSON file ``{"classnames": [...], "templates": ["a photo of a {c}.", ...]}`` (either key optional), or
    the name of a packaged set (``cifar10``, ``imagenet``, ...; see :func:`packaged_class_sets`)."""
    if not path:
        return None, None
    if not storage.is_s3(path) and not Path(path).exists() and path in packaged_class_sets():
        text = packaged_class_set(path)
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


def packaged_set(name: str, split: str) -> ImageSet:
    """A packaged set (``cloob_core/data/packaged.py``): its classes, held-out prompts and each image's caption."""
    from cloob_core.data.packaged import load_packaged

    data = load_packaged(name, split)
    return ImageSet(
        name=f"{name}-{split}", identity=f"packaged:{name}:{split}",
        opener=lambda i: Image.open(io.BytesIO(data.images[i])).convert("RGB"), size=len(data),
        labels=list(data.labels), classnames=list(data.classnames), captions=[[c] for c in data.captions],
        templates=list(data.templates))


def sklearn_digits_set(split: str) -> ImageSet:
    """scikit-learn's 1,797 handwritten digits (UCI "Optical Recognition of Handwritten Digits", CC BY 4.0; 8x8,
    16 grey levels, ink bright like MNIST's), shipped inside scikit-learn so they need no download. Split as
    scikit-learn's own digit-classification example splits them: the first half trains, the second half tests."""
    from sklearn.datasets import load_digits

    from cloob_core.data.mnist import CLASSNAMES, ZERO_SHOT_TEMPLATES

    data = load_digits()
    half = len(data.target) // 2
    parts = {"train": slice(0, half), "test": slice(half, None)}
    if split not in parts:
        raise ConfigError(f"sklearn-digits has the splits train and test, not {split!r}")
    pixels = (data.images[parts[split]] * (255 / 16)).round().astype("uint8")
    return ImageSet(name=f"sklearn-digits-{split}", identity=f"sklearn-digits:{split}",
                    opener=lambda i: Image.fromarray(pixels[i], mode="L").convert("RGB"), size=len(pixels),
                    labels=[int(v) for v in data.target[parts[split]]], classnames=list(CLASSNAMES),
                    templates=list(ZERO_SHOT_TEMPLATES))


def image_folder_set(root: Path, name: str) -> ImageSet:
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(root))
    return ImageSet(name=name, identity=f"folder:{root.resolve()}:{len(folder)}",
                    opener=lambda i: folder.loader(folder.samples[i][0]).convert("RGB"), size=len(folder),
                    labels=[label for _, label in folder.samples], classnames=list(folder.classes))


@dataclass
class _Sample:
    image: bytes
    captions: list[str]
    label: int | None
    classname: str | None = None


def _read_tars(urls: list[str], location: str,
               parse: Callable[[dict[str, Any]], _Sample]) -> tuple[list[_Sample], int]:
    """Every sample ``parse`` accepts, its image decoded once to prove it opens; a sample or tar that does not
    read is left out and counted, as in training. (samples, skipped)"""
    import webdataset as wds

    from cloob_core.data.shard_files import SkipCounter, register_s3

    register_s3()
    handler, samples = SkipCounter(), []
    for raw in wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(handler=handler)):
        try:
            sample = parse(raw)
            Image.open(io.BytesIO(sample.image)).load()
        except Exception as err:  # whatever a broken member raises
            handler(err)
            continue
        samples.append(sample)
    if not samples:
        raise ConfigError(f"{location}: no readable sample in {len(urls)} shard(s) ({handler.skipped} skipped)")
    if handler.skipped:
        log.warning("%s: %d unreadable sample(s) or shard(s) skipped", location, handler.skipped)
    return samples, handler.skipped


def _image_of(raw: dict[str, Any]) -> bytes:
    return next(raw[key] for key in ("jpg", "jpeg", "png", "webp") if key in raw)


def _image_set(name: str, identity: str, samples: list[_Sample], skipped: int, *, classnames: list[str] | None,
               templates: list[str] | None = None) -> ImageSet:
    labels = [s.label for s in samples if s.label is not None]
    images = [s.image for s in samples]
    return ImageSet(name=name, identity=f"{identity}:{len(samples)}",
                    opener=lambda i: Image.open(io.BytesIO(images[i])).convert("RGB"), size=len(samples),
                    labels=labels if len(labels) == len(samples) else None, classnames=classnames,
                    captions=[s.captions for s in samples] if all(s.captions for s in samples) else None,
                    templates=templates, skipped=skipped)


def shard_set(location: str, label_key: str) -> ImageSet:
    """WebDataset shards from `cloob data`: images, captions, and the class field ``label_key`` of the json."""
    from cloob_core.data.shard_files import shard_list

    def parse(raw: dict[str, Any]) -> _Sample:
        meta = json.loads(raw["json"]) if "json" in raw else {}
        label = int(meta[label_key]) if label_key in meta else None
        return _Sample(_image_of(raw), [raw["txt"].decode("utf-8")] if "txt" in raw else [], label,
                       str(meta["classname"]) if label is not None and "classname" in meta else None)

    urls, _ = shard_list(location)
    samples, skipped = _read_tars(urls, location, parse)
    names = {s.label: s.classname for s in samples if s.classname is not None}
    classnames = [names[i] for i in sorted(names)] if names and sorted(names) == list(range(len(names))) else None
    return _image_set(Path(location.rstrip("/")).name, f"shards:{location}", samples, skipped,
                      classnames=classnames)


def is_wds_set(location: str, split: str) -> bool:
    from cloob_core.data.wds_layout import SHARD_COUNT_FILE

    return storage.exists(storage.join(location, split, SHARD_COUNT_FILE))


def wds_set(location: str, split: str) -> ImageSet:
    """CLIP_benchmark's ``wds`` layout (what `cloob data eval-set` writes, and what CLIP_benchmark publishes):
    ``SPLIT/{0..n-1}.tar`` with an image and ``cls`` (or ``txt`` captions, one per line, for a set whose
    ``dataset_type.txt`` says retrieval), ``classnames.txt`` and ``zeroshot_classification_templates.txt``."""
    from cloob_core.data.wds_layout import CLASSNAMES_FILE, DATASET_TYPE_FILE, SHARD_COUNT_FILE, TEMPLATES_FILE

    publish.unit_of(location)  # a set whose publication a killed `cloob data eval-set` left half-done: completed

    def lines(name: str) -> list[str] | None:
        try:
            text = storage.read_bytes(storage.join(location, name)).decode("utf-8")
        except FileNotFoundError:
            return None
        return [line.strip() for line in text.splitlines() if line.strip()]

    count = (lines(f"{split}/{SHARD_COUNT_FILE}") or [""])[0]
    if not count.isdigit() or int(count) < 1:
        raise ConfigError(f"{storage.join(location, split, SHARD_COUNT_FILE)} must hold the number of shards, "
                          f"got {count!r}")
    retrieval = (lines(DATASET_TYPE_FILE) or ["classification"])[0].lower() == "retrieval"

    def parse(raw: dict[str, Any]) -> _Sample:
        if retrieval:
            return _Sample(_image_of(raw), raw["txt"].decode("utf-8").splitlines(), None)
        return _Sample(_image_of(raw), [], int(raw["cls"]))

    urls = [storage.join(location, split, f"{i}.tar") for i in range(int(count))]
    samples, skipped = _read_tars(urls, location, parse)
    templates = lines(TEMPLATES_FILE)
    return _image_set(f"{Path(location.rstrip('/')).name}-{split}", f"wds:{location}:{split}", samples, skipped,
                      classnames=None if retrieval else lines(CLASSNAMES_FILE),
                      templates=[t.replace("{c}", "{}") for t in templates] if templates else None)


CSV_COLUMNS = ("image", "caption")  # a captions CSV's columns unless --url-col / --caption-col name others


def caption_csv_set(path: Path, columns: tuple[str, str] = CSV_COLUMNS) -> ImageSet:
    """A CSV of image paths and captions in ``columns`` (relative paths read from the CSV's folder, the one rule
    of :func:`cloob_core.data.sources.table_file`); repeated images have several captions."""
    image, caption = columns
    by_image: dict[Path, list[str]] = {}
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if not {image, caption} <= set(reader.fieldnames or ()):
            raise ConfigError(f"{path} needs the columns {image},{caption} (name others with --url-col and "
                              f"--caption-col); it has {reader.fieldnames}")
        for number, row in enumerate(reader, start=1):
            by_image.setdefault(table_file(path, row[image], image, number), []).append(row[caption])
    files = list(by_image)
    named = "" if columns == CSV_COLUMNS else f":{image}:{caption}"  # other columns: other images, other features
    return ImageSet(name=path.stem, identity=f"captions:{path.resolve()}{named}:{len(files)}",
                    opener=lambda i: Image.open(files[i]).convert("RGB"), size=len(files),
                    captions=[by_image[f] for f in files])


def load_images(source: str, split: str = "test", label_key: str = "label", class_file: str | None = None,
                csv_columns: tuple[str, str] = CSV_COLUMNS) -> ImageSet:
    """A packaged set or ``sklearn-digits`` (split train/test), CLIP_benchmark's ``wds`` layout
    (``SPLIT/nshards.txt``; local or s3://), a folder (ImageFolder; ``SPLIT/`` inside it if present), shards (a
    folder with sizes.json, .tar, brace pattern, s3://), or a .csv of image paths and captions."""
    if source in PACKAGED_SETS:
        images = packaged_set(source, split)
    elif source == "sklearn-digits":
        images = sklearn_digits_set(split)
    elif source.endswith(".csv"):
        images = caption_csv_set(Path(source), csv_columns)
    elif is_wds_set(source, split):
        images = wds_set(source, split)
    elif storage.is_s3(source) or source.endswith(".tar") or "{" in source or (Path(source) / "sizes.json").exists():
        images = shard_set(source, label_key)
    elif Path(source).is_dir():
        top = Path(source).resolve()
        if (top / split).is_dir():  # results are named after the data set, with the split: digits-test
            images = image_folder_set(top / split, f"{top.name}-{split}")
        else:
            images = image_folder_set(top, top.name)
    else:
        raise FileNotFoundError(f"{source}: not a packaged set ({', '.join(PACKAGED_SOURCES)}), an image folder, "
                                "shards or a captions .csv")
    names, templates = read_class_file(class_file)
    if names is not None:
        if images.labels is not None and max(images.labels) >= len(names):
            raise ValueError(f"{class_file} lists {len(names)} class names, the data has label {max(images.labels)}")
        images.classnames = names
    if templates is not None:
        images.templates = templates
    if images.classnames is not None and images.templates is None:  # an ImageFolder, shards with classes: no dead end
        images.templates = default_templates()
        log.warning("%s came with no prompt templates: zero-shot uses CLIP's 7 general ones ('%s', ...); give "
                    "--classnames FILE with a 'templates' list for your own", images.name, images.templates[0])
    return images


def default_templates() -> list[str]:
    """open_clip's SIMPLE_IMAGENET_TEMPLATES, the CLIP paper's ensemble of 7 general prompts, as format strings."""
    from open_clip.zero_shot_metadata import SIMPLE_IMAGENET_TEMPLATES

    return [template("{}") for template in SIMPLE_IMAGENET_TEMPLATES]
