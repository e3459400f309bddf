"""``cloob data eval-set``: a benchmark set as WebDataset shards in CLIP_benchmark's ``wds`` layout, so that
one copy of it serves `cloob eval`, CLIP_benchmark and open_clip users alike. A classification set::

    OUTPUT/dataset_type.txt                        "classification"
    OUTPUT/classnames.txt                          one class name per line, in label order
    OUTPUT/zeroshot_classification_templates.txt   one prompt per line, {c} where the class name goes
    OUTPUT/SPLIT/0.tar, 1.tar, …                   samples s0000000, …: the image (jpg/png/webp) and cls
    OUTPUT/SPLIT/nshards.txt                       the number of tars
    OUTPUT/SPLIT/sizes.json                        each tar's samples (ours; CLIP_benchmark reads without it)

A retrieval set (image–text retrieval, CLIP_benchmark's ``zeroshot_retrieval``) has ``dataset_type.txt`` saying
"retrieval", no class files, and ``txt`` in place of ``cls``: the image's captions, one per line.

The source is an ImageFolder tree (``CLASS/IMAGE``, or ``SPLIT/CLASS/IMAGE`` for several splits; classification
only), a manifest (an image path relative to the manifest and a class name, or a caption, per row; optionally a
split column; an image on several rows has several captions), or a packaged set (``captioned``, ``mnist``, ...:
both splits, their class names and held-out prompts, or each image's caption). Labels follow torchvision's
ImageFolder: classes in sorted order, images sorted within each class. Images already in a format CLIP_benchmark
decodes are copied byte for byte; others become PNG. An image that does not decode is left out and counted.
The set is published as one unit (:mod:`cloob_core.publish`): a run that stops leaves the previous set whole.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cloob_core import lease, publish, storage
from cloob_core.config import PACKAGED_SETS, ConfigError
from cloob_core.data.manifest import read_manifest, table_file, table_folder
from cloob_core.data.packaged import SPLITS, PackagedSplit, load_packaged
from cloob_core.data.sources import IMAGE_SUFFIXES
from cloob_core.data.wds_layout import CLASSNAMES_FILE, DATASET_TYPE_FILE, SHARD_COUNT_FILE, TEMPLATES_FILE
from cloob_core.data.writer import ShardWriter
from cloob_core.io import atomic_write, json_bytes

log = logging.getLogger(__name__)
DEFAULT_TEMPLATES = ("a photo of a {c}.",)
_COPIED = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}  # what CLIP_benchmark's wds reader decodes


SetKind = Literal["classification", "retrieval"]  # CLIP_benchmark's dataset_type.txt


@dataclass(frozen=True)
class _Image:
    name: str  # for messages
    read: Callable[[], bytes]


def _file(path: Path) -> _Image:
    return _Image(str(path), path.read_bytes)


@dataclass(frozen=True)
class ManifestColumns:
    """Where a manifest keeps each part of a sample: the image path, its class (a classification set) or its
    caption (a retrieval set), and its split (optional: without it every row is in ``--split``)."""

    image: str = "image"
    label: str = "label"
    caption: str = "caption"
    split: str = "split"


@dataclass
class EvalSetResult:
    output: str
    kind: SetKind
    classnames: list[str]  # empty for a retrieval set
    samples: dict[str, int]  # images per split
    captions: dict[str, int] = field(default_factory=dict)  # per split, for a retrieval set
    skipped: dict[str, int] = field(default_factory=dict)  # undecodable images left out, per split


# A split's rows: each image with the members it is stored with beside it (cls, or txt).
_Rows = list[tuple[_Image, dict[str, bytes]]]


@lease.holding("output")
def build_eval_set(source: str, output: str, *, kind: SetKind = "classification", split: str = "test",
                   columns: ManifestColumns = ManifestColumns(), classnames: list[str] | None = None,
                   templates: list[str] | None = None, shard_size: int = 1_000) -> EvalSetResult:
    """Convert ``source`` (a packaged set's name, a folder or a manifest file) into ``output`` (a folder or s3://
    prefix). ``classnames`` replaces the folder or label names as displayed (same count, same order); ``split``
    names the split of a source that has none."""
    if shard_size < 1:
        raise ConfigError(f"--shard-size must be at least 1, got {shard_size}")
    if kind == "retrieval":
        if classnames is not None or templates is not None:
            raise ConfigError("--classnames is for a classification set; a retrieval set has captions instead")
        splits, names = _caption_splits(source, columns, split), []
    else:
        splits, names, templates = _class_splits(source, columns, split, classnames, templates)
    storage.ensure_folder(output)
    result = EvalSetResult(output, kind, names, {})
    with publish.staged(output) as staging:  # the set appears whole, or the previous one stays
        _write_text(str(staging / DATASET_TYPE_FILE), [kind])
        if kind == "classification":
            _write_text(str(staging / CLASSNAMES_FILE), names)
            _write_text(str(staging / TEMPLATES_FILE), _check_templates(templates or list(DEFAULT_TEMPLATES)))
        for name, rows in sorted(splits.items()):
            written, skipped = _write_split(str(staging / name), rows, shard_size)
            result.samples[name], result.skipped[name] = written, skipped
            if kind == "retrieval":
                result.captions[name] = sum(len(fields["txt"].splitlines()) for _, fields in rows)
            log.info("%s: %d images%s", name, written, f", {skipped} unreadable left out" if skipped else "")
    return result


def _class_splits(source: str, columns: ManifestColumns, split: str, classnames: list[str] | None,
                  templates: list[str] | None) -> tuple[dict[str, _Rows], list[str], list[str] | None]:
    """A classification set's rows per split (each image with its label index), class names and templates."""
    root = Path(source)
    if source in PACKAGED_SETS:
        labelled, classnames, templates = _packaged_splits(source, classnames, templates)
    elif root.is_dir():
        labelled = _folder_splits(root, split)
    elif root.is_file() or storage.is_s3(source):
        labelled = _manifest_splits(source, columns.image, columns.label, columns.split, split)
        labelled = {name: sorted(rows, key=lambda r: (r[1], r[0].name)) for name, rows in labelled.items()}
    else:
        raise ConfigError(f"--source {source} is neither a packaged set, an image folder nor a manifest file")
    labels = sorted({label for rows in labelled.values() for _, label in rows})
    index = {label: i for i, label in enumerate(labels)}
    rows = {name: [(image, {"cls": str(index[label]).encode()}) for image, label in part]
            for name, part in labelled.items()}
    return rows, _display_names(labels, classnames), templates


def _caption_splits(source: str, columns: ManifestColumns, split: str) -> dict[str, _Rows]:
    """A retrieval set's rows per split: each image once, in the order of its first row, with all its captions
    (a caption's line breaks become spaces: the ``txt`` member holds one caption per line)."""
    if source in PACKAGED_SETS:
        parts = {name: load_packaged(source, name) for name in SPLITS}
        captioned = {name: [(_packaged_image(part, i), caption) for i, caption in enumerate(part.captions)]
                     for name, part in parts.items()}
    elif Path(source).is_file() or storage.is_s3(source):
        captioned = _manifest_splits(source, columns.image, columns.caption, columns.split, split)
    else:
        raise ConfigError(f"--source {source}: a retrieval set needs captions, from a packaged set or a manifest "
                          f"with the columns {columns.image},{columns.caption}")
    rows: dict[str, _Rows] = {}
    for name, part in captioned.items():
        by_image: dict[str, tuple[_Image, list[str]]] = {}
        for image, caption in part:
            by_image.setdefault(image.name, (image, []))[1].append(" ".join(caption.split()))
        rows[name] = [(image, {"txt": "\n".join(captions).encode("utf-8")}) for image, captions in by_image.values()]
    return rows


SPLIT_NAMES = frozenset({"train", "test", "val", "validation"})


def _packaged_splits(name: str, classnames: list[str] | None, templates: list[str] | None
                     ) -> tuple[dict[str, list[tuple[_Image, str]]], list[str], list[str]]:
    """Both splits of a packaged set (images as the download stage stores them), labelled so that they sort in
    label order, with their class names and held-out prompts unless others are given."""
    data = {split: load_packaged(name, split) for split in SPLITS}
    splits = {split: sorted(((_packaged_image(part, i), f"{label:03d}") for i, label in enumerate(part.labels)),
                            key=lambda row: row[1])
              for split, part in data.items()}
    return (splits, classnames or list(data["test"].classnames),
            templates or [t.replace("{}", "{c}") for t in data["test"].templates])


def _packaged_image(part: PackagedSplit, index: int) -> _Image:
    return _Image(part.url(index), lambda: part.images[index])


def _folder_splits(root: Path, split: str) -> dict[str, list[tuple[_Image, str]]]:
    """``{split: [(image, class)]}``: ``root/SPLIT/CLASS/…`` when the subfolders are split names (train, test,
    val, validation); otherwise ``root/CLASS/…`` as the one split ``split``."""
    subfolders = sorted(p for p in root.iterdir() if p.is_dir())
    if subfolders and {s.name for s in subfolders} <= SPLIT_NAMES:
        return {s.name: _class_images(s) for s in subfolders}
    return {split: _class_images(root)}


def _class_images(root: Path) -> list[tuple[_Image, str]]:
    rows = [(_file(image), folder.name)
            for folder in sorted(p for p in root.iterdir() if p.is_dir())
            for image in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)]
    if not rows:
        raise ConfigError(f"no CLASS/IMAGE files ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    return rows


def _manifest_splits(location: str, image_col: str, text_col: str, split_col: str,
                     split: str) -> dict[str, list[tuple[_Image, str]]]:
    """``{split: [(image, text)]}`` in row order: the text is a class name or a caption."""
    frame = read_manifest(location, image_col, text_col)
    base = table_folder(location)
    splits: dict[str, list[tuple[_Image, str]]] = {}
    for number, row in enumerate(frame.itertuples(index=False), start=1):
        record = row._asdict()
        path = table_file(location, record[image_col], image_col, number, inside=base)
        text = str(record[text_col] or "").strip()
        if not text:
            raise ConfigError(f"{location}, row {number}, column {text_col!r}: empty")
        name = str(record.get(split_col) or split)
        splits.setdefault(name, []).append((_file(path), text))
    if not splits:
        raise ConfigError(f"manifest {location} has no rows")
    return splits


def _display_names(labels: list[str], classnames: list[str] | None) -> list[str]:
    if classnames is None:
        return [label.replace("_", " ") for label in labels]
    if len(classnames) != len(labels):
        raise ConfigError(f"--classnames lists {len(classnames)} names, the source has {len(labels)} classes "
                          f"({', '.join(labels[:5])}{', …' if len(labels) > 5 else ''})")
    return list(classnames)


def _check_templates(templates: list[str]) -> list[str]:
    """CLIP_benchmark fills ``{c}``; our class files may write ``{}``."""
    converted = [t.replace("{}", "{c}") for t in templates]
    blind = [t for t in converted if "{c}" not in t]
    if blind:
        raise ConfigError(f"template {blind[0]!r} has no {{c}} for the class name")
    return converted


def _write_text(location: str, lines: list[str]) -> None:
    if any("\n" in line for line in lines):
        raise ConfigError(f"{location}: a line of it would contain a line break")
    storage.write_bytes(location, ("\n".join(lines) + "\n").encode("utf-8"))


def _image_member(image: _Image) -> tuple[str, bytes] | None:
    """(extension, bytes) as stored: the file itself when CLIP_benchmark decodes its format, else PNG; None
    when it does not decode."""
    from PIL import Image

    data = image.read()
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            if image.format in _COPIED:
                return _COPIED[image.format], data
            out = io.BytesIO()
            image.save(out, format="PNG")
            return "png", out.getvalue()
    except Exception as err:  # whatever the codecs raise
        log.warning("leaving out %s: %s: %s", image.name, type(err).__name__, err)
        return None


def _write_split(folder: str, rows: _Rows, shard_size: int) -> tuple[int, int]:
    """The tars, then ``sizes.json`` and ``nshards.txt``, into the local staging folder ``folder``; (images
    written, images left out)."""
    storage.ensure_folder(folder)
    written = skipped = 0
    sizes: dict[str, int] = {}  # each tar's samples, so that a reader counts what a broken tar lost
    pending: list[tuple[str, bytes, dict[str, bytes]]] = []

    def flush() -> None:
        if not pending:
            return
        name = f"{len(sizes)}.tar"
        _write_tar(storage.join(folder, name), pending, first=written - len(pending))
        sizes[name] = len(pending)
        pending.clear()

    for image, fields in rows:
        member = _image_member(image)
        if member is None:
            skipped += 1
            continue
        pending.append((*member, fields))
        written += 1
        if len(pending) == shard_size:
            flush()
    flush()
    if written == 0:
        raise ConfigError(f"no image of {folder} decodes ({skipped} tried)")
    storage.write_bytes(storage.join(folder, "sizes.json"), json_bytes(sizes))
    storage.write_bytes(storage.join(folder, SHARD_COUNT_FILE), f"{len(sizes)}\n".encode())
    return written, skipped


def _write_tar(location: str, samples: list[tuple[str, bytes, dict[str, bytes]]], first: int) -> None:
    """One tar of samples keyed ``s%07d`` by their index in the split (as CLIP_benchmark's exporter keys them)."""

    def write(target: Path) -> None:
        with open(target, "wb") as stream, ShardWriter(stream) as writer:
            for offset, (extension, data, fields) in enumerate(samples):
                writer.write_sample({"__key__": f"s{first + offset:07d}", extension: data, **fields})

    atomic_write(location, write)
