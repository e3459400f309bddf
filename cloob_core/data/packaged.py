"""The data sets that ship inside the package, by name: a run trains on them and the suite evaluates on them
without a path, a download or a network.

- ``captioned`` (the default): 2,551 real image-caption pairs from Tux Paint's stamps and Microsoft's Fluent
  Emoji (``captioned.py``), labelled by category (Tux Paint's folder, the Unicode emoji group).
- ``tuxpaint`` and ``fluent-emoji``: its two sources alone, as classification sets with 15 and 9 classes.
- ``mnist``: 5,000 MNIST digits with template captions (``mnist.py``).

Each has the splits ``train`` and ``test`` (held out, never trained on). A manifest row names one image as
``packaged:NAME/SPLIT/INDEX``; ``sources.PackagedSource`` gives the download engine its bytes, so packaged images
go through the very checks, resizing and records downloaded ones do.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass, field
from functools import lru_cache

from cloob_core.config import PACKAGED_SETS
from cloob_core.data.manifest import ManifestError

PREFIX = "packaged:"
SPLITS = ("train", "test")
URL_PATTERN = rf"{PREFIX}(?:{'|'.join(map(re.escape, PACKAGED_SETS))})/(?:{'|'.join(SPLITS)})/\d+"

# Zero-shot prompts: phrasings the captions never use, so zero-shot measures transfer, not recall of captions.
_CAPTIONED_TEMPLATES = ("a picture of {}.", "a photo of {}.", "{}.")
_TEMPLATES = {"tuxpaint": ("a picture of {}.", "a photo of {}.", "a drawing of {}.", "{}."),
              "fluent-emoji": ("an emoji of {}.", "a 3d icon of {}.", "a picture of {}.", "{}."),
              "captioned": _CAPTIONED_TEMPLATES}
_DISPLAY = {"naturalforces": "natural forces"}  # Tux Paint folder names that are not words


@dataclass(frozen=True)
class PackagedSplit:
    """One split of a packaged set: encoded images (as a shard stores them) and their captions and classes."""

    name: str
    split: str
    images: tuple[bytes, ...]
    captions: tuple[str, ...]  # each image's own caption: what retrieval scores against
    variants: tuple[tuple[str, ...], ...]  # every phrasing of each image's caption, its own first (text views)
    labels: tuple[int, ...]
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    columns: dict[str, tuple] = field(default_factory=dict)  # further manifest columns (source, category, ...)

    def __len__(self) -> int:
        return len(self.images)

    def url(self, index: int) -> str:
        return f"{PREFIX}{self.name}/{self.split}/{index}"

    def rows(self) -> list[dict]:
        return [{"url": self.url(i), "caption": self.captions[i], "captions": list(self.variants[i]),
                 "label": self.labels[i], "classname": self.classnames[self.labels[i]], "split": self.split,
                 **{key: values[i] for key, values in self.columns.items()}} for i in range(len(self))]


def _check(name: str, split: str) -> None:
    if name not in PACKAGED_SETS:
        raise ManifestError(f"no packaged data set {name!r}; there are {', '.join(PACKAGED_SETS)}")
    if split not in SPLITS:
        raise ManifestError(f"packaged set {name} has the splits {' and '.join(SPLITS)}, not {split!r}")


@lru_cache(maxsize=16)
def load_packaged(name: str, split: str) -> PackagedSplit:
    _check(name, split)
    return _mnist(split) if name == "mnist" else _captioned(name, split)


def _captioned(name: str, split: str) -> PackagedSplit:
    from cloob_core.data.captioned import load_captioned

    everything = load_captioned("all")
    if name != "captioned":
        everything = everything[everything["source"] == name]
    # Classes from both splits, so that train and test share one labelling.
    classes = sorted(set(everything["category"]))
    pairs = everything[everything["split"] == split]
    index = {category: i for i, category in enumerate(classes)}

    captions = tuple(_with_keywords(c, list(k)) for c, k in zip(pairs["caption"], pairs["keywords"], strict=True))
    return PackagedSplit(
        name=name, split=split, images=tuple(pairs["image"]), captions=captions,
        variants=tuple((own, name) if own != name else (own,) for own, name in zip(captions, pairs["caption"],
                                                                                   strict=True)),
        labels=tuple(index[c] for c in pairs["category"]),
        classnames=tuple(_DISPLAY.get(c, c) for c in classes), templates=_TEMPLATES[name],
        columns={key: tuple(pairs[key]) for key in ("key", "source", "category", "subcategory")})


def _with_keywords(name: str, keywords: list[str]) -> str:
    """An emoji's caption: its name with the keywords the name does not already say, "roller coaster (amusement,
    park, theme)". The keywords are the words a group shares ("food", "animal", "flag"), which the names alone
    rarely hold; Tux Paint's sentences have none and stay as they are."""
    said = set(re.findall(r"[\w']+", name.lower()))
    extra = [keyword for keyword in keywords if keyword.lower() not in said]
    return f"{name} ({', '.join(extra)})" if extra else name


def _mnist(split: str) -> PackagedSplit:
    from PIL import Image

    from cloob_core.data.mnist import CAPTION_TEMPLATES, CLASSNAMES, ZERO_SHOT_TEMPLATES, caption_for, load_mnist

    data = load_mnist(split)

    def png(pixels) -> bytes:  # lossless: the digits are stored as they ship
        out = io.BytesIO()
        Image.fromarray(pixels, mode="L").save(out, format="PNG")
        return out.getvalue()

    def variants(label: int, caption: str) -> tuple[str, ...]:
        others = (caption_for(label, t) for t in range(len(CAPTION_TEMPLATES)))
        return (caption, *(other for other in others if other != caption))

    return PackagedSplit(
        name="mnist", split=split, images=tuple(png(image) for image in data.images), captions=data.captions,
        variants=tuple(variants(int(label), c) for label, c in zip(data.labels, data.captions, strict=True)),
        labels=tuple(int(label) for label in data.labels), classnames=CLASSNAMES, templates=ZERO_SHOT_TEMPLATES)


def parse_url(url: str) -> tuple[str, str, int]:
    """``packaged:NAME/SPLIT/INDEX`` -> (name, split, index); a malformed one is a :class:`ManifestError`."""
    parts = url.removeprefix(PREFIX).split("/")
    if not url.startswith(PREFIX) or len(parts) != 3 or not parts[2].isdigit():
        raise ManifestError(f"{url!r} is not {PREFIX}NAME/SPLIT/INDEX")
    _check(parts[0], parts[1])
    return parts[0], parts[1], int(parts[2])
