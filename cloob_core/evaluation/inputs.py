"""What an evaluation embeds: labelled or captioned images, named by a source (a packaged set's held-out split,
an ImageFolder tree, WebDataset shards, CLIP_benchmark's ``wds`` layout, or a CSV of image paths and captions).

An :class:`ImageSet` says how its images are read, and reads none of them: a set known by index (a packaged set,
a folder, a CSV) opens image ``i`` on demand; shards are a :class:`ShardStream` that webdataset reads front to
back, so that neither kind holds more than the images in flight (:mod:`cloob_core.evaluation.image_loader` reads
them in data-loader workers). A stream's labels and captions arrive with its samples.
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from cloob_core import publish, storage
from cloob_core.config import PACKAGED_SETS, PACKAGED_SOURCES, ConfigError
from cloob_core.data.manifest import table_file
from cloob_core.data.shard_files import IMAGE_KEYS
from cloob_core.evaluation.class_sets import packaged_class_set, packaged_class_sets
from cloob_core.io import json_digest

log = logging.getLogger(__name__)


class Record(NamedTuple):
    """What a sample carries besides its image."""

    label: int | None = None
    captions: tuple[str, ...] = ()
    classname: str | None = None  # a shard sample's own name for its label


@dataclass(frozen=True)
class Indexed:
    """A set read by index: ``open(i)`` decodes image ``i``; labels and captions are known up front."""

    size: int
    open: Callable[[int], Image.Image]  # picklable, for data-loader workers started by spawn
    labels: Sequence[int] | None = None
    captions: Sequence[Sequence[str]] | None = None

    def record(self, index: int) -> Record:
        return Record(None if self.labels is None else int(self.labels[index]),
                      tuple(self.captions[index]) if self.captions is not None else ())


@dataclass(frozen=True)
class ShardStream:
    """WebDataset shards read front to back: ``parse`` turns a sample's fields into its image bytes and record."""

    urls: tuple[str, ...]
    location: str
    parse: Callable[[dict[str, Any]], tuple[bytes, Record]]  # picklable, as ``Indexed.open``
    sizes: tuple[int, ...] | None = None  # each tar's samples, where the set records them (sizes.json)


@dataclass
class ImageSet:
    """Images with labels and/or captions, read by ``reader``; ``identity`` names them for caches and reports.
    ``classnames`` and ``templates`` are the set's (or a class file's); shards may name their classes in their
    samples instead (see :func:`class_prompts`)."""

    name: str
    identity: str
    reader: Indexed | ShardStream
    classnames: list[str] | None = None
    templates: list[str] | None = None
    class_file: str | None = None  # where classnames came from, when a file gave them


@dataclass(frozen=True)
class _EncodedImages:
    """Images held encoded in memory (a packaged set)."""

    images: Sequence[bytes]

    def __call__(self, index: int) -> Image.Image:
        return Image.open(io.BytesIO(self.images[index])).convert("RGB")


@dataclass(frozen=True)
class _GreyPixels:
    """Images held as grey uint8 pixels (scikit-learn's digits)."""

    pixels: np.ndarray

    def __call__(self, index: int) -> Image.Image:
        return Image.fromarray(self.pixels[index], mode="L").convert("RGB")


@dataclass(frozen=True)
class _ImageFiles:
    """Image files, opened as torchvision's ImageFolder opens them."""

    paths: Sequence[str]

    def __call__(self, index: int) -> Image.Image:
        with open(self.paths[index], "rb") as handle:
            return Image.open(handle).convert("RGB")


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
        reader=Indexed(len(data), _EncodedImages(data.images), list(data.labels), [[c] for c in data.captions]),
        classnames=list(data.classnames), templates=list(data.templates))


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
                    reader=Indexed(len(pixels), _GreyPixels(pixels), [int(v) for v in data.target[parts[split]]]),
                    classnames=list(CLASSNAMES), templates=list(ZERO_SHOT_TEMPLATES))


def image_folder_set(root: Path, name: str) -> ImageSet:
    from torchvision.datasets import ImageFolder

    folder = ImageFolder(str(root))
    return ImageSet(name=name, identity=f"folder:{root.resolve()}:{len(folder)}",
                    reader=Indexed(len(folder), _ImageFiles([path for path, _ in folder.samples]),
                                   [label for _, label in folder.samples]),
                    classnames=list(folder.classes))


def sample_image(raw: dict[str, Any]) -> bytes:
    """A WebDataset sample's image bytes: its jpg, jpeg, png or webp member."""
    found = next((raw[key] for key in IMAGE_KEYS if key in raw), None)
    if found is None:
        raise ValueError(f"sample {raw.get('__key__')!r} has no image (jpg, jpeg, png or webp)")
    return found


def _class_label(value: Any) -> int:
    """A sample's class as a whole number (3, "3"), never a number cut to one (3.7 read as 3) or a boolean."""
    if isinstance(value, bytes):
        value = value.decode("utf-8").strip()
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"label {str(value)[:40]!r} is not a whole number")


def _shard_sample(raw: dict[str, Any], label_key: str) -> tuple[bytes, Record]:
    """A `cloob data` shard's sample: its image, caption (``txt``) and the class field ``label_key`` of its json."""
    meta = json.loads(raw["json"]) if "json" in raw else {}
    label = _class_label(meta[label_key]) if label_key in meta else None
    return sample_image(raw), Record(label, (raw["txt"].decode("utf-8"),) if "txt" in raw else (),
                                  str(meta["classname"]) if label is not None and "classname" in meta else None)


def _wds_sample(raw: dict[str, Any], retrieval: bool) -> tuple[bytes, Record]:
    """A CLIP_benchmark ``wds`` sample: its image and ``cls``, or (a retrieval set) its captions, one per line."""
    if retrieval:
        return sample_image(raw), Record(None, tuple(raw["txt"].decode("utf-8").splitlines()))
    return sample_image(raw), Record(_class_label(raw["cls"]))


def _files_identity(urls: Sequence[str]) -> str:
    """The shards' sizes and versions (S3 ETags, local size and time), from one listing per folder rather than a
    request per tar: a set rewritten in place is another set to the features cache. Counting the samples would
    mean reading them. A folder storage cannot list (http://, pipe:) is known by its shards' names."""
    from cloob_core.data.shard_files import shard_listings

    listings = shard_listings(list(urls))
    found = []
    for folder in sorted({url.rpartition("/")[0] or "." for url in urls}):
        names = {url.rpartition("/")[2] for url in urls if (url.rpartition("/")[0] or ".") == folder}
        entries = listings.get(folder, {})
        listed: list[Any] = [[name, *entries[name]] for name in sorted(names) if name in entries] if entries \
            else sorted(names)
        found.append([folder, listed])
    return json_digest(found)[:16]


def shard_set(location: str, label_key: str) -> ImageSet:
    """WebDataset shards from `cloob data`: images, captions, and the class field ``label_key`` of the json."""
    from cloob_core.data.shard_files import shard_list, shard_sizes

    urls, _ = shard_list(location)
    sizes = None if "{" in location or location.endswith(".tar") else shard_sizes(location)
    return ImageSet(name=Path(location.rstrip("/")).name,
                    identity=f"shards:{location}:{label_key}:{_files_identity(urls)}",
                    reader=ShardStream(tuple(urls), location, partial(_shard_sample, label_key=label_key),
                                       None if sizes is None else tuple(sizes.values())))


def is_wds_set(location: str, split: str) -> bool:
    from cloob_core.data.wds_layout import SHARD_COUNT_FILE

    return storage.exists(storage.join(location, split, SHARD_COUNT_FILE))


def wds_set(location: str, split: str) -> ImageSet:
    """CLIP_benchmark's ``wds`` layout (what `cloob data eval-set` writes, and what CLIP_benchmark publishes):
    ``SPLIT/{0..n-1}.tar`` with an image and ``cls`` (or ``txt`` captions, one per line, for a set whose
    ``dataset_type.txt`` says retrieval), ``classnames.txt`` and ``zeroshot_classification_templates.txt``."""
    from cloob_core.data.shard_files import shard_sizes
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
    urls = [storage.join(location, split, f"{i}.tar") for i in range(int(count))]
    templates = lines(TEMPLATES_FILE)
    sizes = shard_sizes(storage.join(location, split))  # where `cloob data eval-set` wrote it
    counts = None if sizes is None or list(sizes) != urls else tuple(sizes.values())
    return ImageSet(name=f"{Path(location.rstrip('/')).name}-{split}",
                    identity=f"wds:{location}:{split}:{_files_identity(urls)}",
                    reader=ShardStream(tuple(urls), location, partial(_wds_sample, retrieval=retrieval), counts),
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
                    reader=Indexed(len(files), _ImageFiles([str(f) for f in files]),
                                   captions=[by_image[f] for f in files]))


def load_images(source: str, split: str = "test", label_key: str = "label", class_file: str | None = None,
                csv_columns: tuple[str, str] = CSV_COLUMNS) -> ImageSet:
    """A packaged set or ``sklearn-digits`` (split train/test), CLIP_benchmark's ``wds`` layout
    (``SPLIT/nshards.txt``; local or s3://), a folder (ImageFolder; ``SPLIT/`` inside it if present), shards (a
    folder with sizes.json, .tar, brace pattern, s3://), or a .csv of image paths and captions. Nothing is read
    but the set's listing and class files."""
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
        images.classnames, images.class_file = names, class_file
    if templates is not None:
        images.templates = templates
    return images


def class_prompts(images: ImageSet, labels: Sequence[int],
                  found: dict[int, str] | None = None) -> tuple[list[str] | None, list[str] | None]:
    """The class names and prompt templates to classify ``images`` with, once its ``labels`` were read: the set's
    (or its class file's) names, else the names its samples gave (``found``: label -> name, shards); the set's
    templates, else CLIP's 7 general ones (said once). A class file with fewer names than the labels is an error."""
    names = images.classnames
    if names is None and found and sorted(found) == list(range(len(found))):
        names = [found[i] for i in range(len(found))]
    if names is not None and labels and max(labels) >= len(names):
        where = images.class_file or images.name
        raise ValueError(f"{where} lists {len(names)} class names, the data has label {max(labels)}")
    templates = images.templates
    if names is not None and templates is None:  # an ImageFolder, shards with classes: no dead end
        templates = default_templates()
        log.warning("%s came with no prompt templates: zero-shot uses CLIP's 7 general ones ('%s', ...); give "
                    "--classnames FILE with a 'templates' list for your own", images.name, templates[0])
        images.templates = templates
    return names, templates


def default_templates() -> list[str]:
    """open_clip's SIMPLE_IMAGENET_TEMPLATES, the CLIP paper's ensemble of 7 general prompts, as format strings."""
    from open_clip.zero_shot_metadata import SIMPLE_IMAGENET_TEMPLATES

    return [template("{}") for template in SIMPLE_IMAGENET_TEMPLATES]
