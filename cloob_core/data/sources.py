"""Where a manifest row's bytes come from: http(s) URLs, files under a local folder, or a packaged set. Each is a
:class:`Source` the download engine plugs in (``open(threads)`` in each worker process, then ``fetch(url)`` per
row), so local and packaged images go through the very checks, resizing, dedup and records that downloaded ones do.
Relative paths of a manifest are read from the manifest's own folder (:func:`~cloob_core.data.manifest.table_file`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from cloob_core.data.fetch import Fetcher, FetchPolicy, FetchResult
from cloob_core.data.manifest import ManifestError
from cloob_core.data.packaged import SPLITS, load_packaged, parse_url

if TYPE_CHECKING:  # pandas only where a frame is built, never in a download worker (a quarter second each)
    import pandas as pd

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class RowReader(Protocol):
    """What a worker process fetches a row's bytes with: a failure is a result with its reason, never raised."""

    def fetch(self, url: str) -> FetchResult: ...


class Source(Protocol):
    """A download source: pickled to each worker process, and opened there once (``threads``: the worker's
    concurrent fetches)."""

    def open(self, threads: int) -> RowReader: ...


@dataclass(frozen=True)
class HttpSource:
    """Rows name http(s) URLs; fetched under the download policy."""

    policy: FetchPolicy

    def open(self, threads: int) -> Fetcher:
        return Fetcher(self.policy, pool_size=threads)


@dataclass(frozen=True)
class FolderSource:
    """Rows name files under ``root``; relative paths are read from ``base`` (a manifest's own folder, by the one
    rule; the folder itself for the sidecar captions). Nothing outside ``root`` is ever read."""

    root: str
    max_bytes: int
    base: str | None = None

    def open(self, threads: int) -> FolderSource:
        return self

    def fetch(self, relative: str) -> FetchResult:
        root = Path(self.root).resolve()
        base = Path(self.base).resolve() if self.base else root
        path = (base / relative).resolve()
        if not path.is_relative_to(root):
            return FetchResult(None, "blocked_path", f"{relative!r} points outside {root}")
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                return FetchResult(None, "too_large", f"{size} bytes > {self.max_bytes}")
            return FetchResult(path.read_bytes(), final_url=str(path))
        except FileNotFoundError:
            return FetchResult(None, "missing_file", f"{path} does not exist ({relative!r} read from {base})")
        except OSError as err:
            return FetchResult(None, "read_error", str(err))


def folder_frame(root: Path) -> pd.DataFrame:
    """Images under ``root`` (sorted, recursive) with the caption of a sidecar ``<stem>.txt``; the parent
    folder's name is kept as ``classname`` (ImageFolder layout)."""
    import pandas as pd

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


@dataclass(frozen=True, eq=False)
class PackagedSource:
    """A download source for ``packaged:`` rows. The encoded images travel to the worker processes with it (10 MB
    for the captioned set), cheaper than each worker reading and encoding them again."""

    images: dict[tuple[str, str], tuple[bytes, ...]]

    def open(self, threads: int) -> PackagedSource:
        return self

    def fetch(self, url: str) -> FetchResult:
        name, split, index = parse_url(url)
        images = self.images[name, split]
        if index >= len(images):
            return FetchResult(None, "missing_file", f"{url}: {name}/{split} has {len(images)} images")
        return FetchResult(images[index], final_url=url)


def packaged_frame(name: str, split: str) -> tuple[pd.DataFrame, PackagedSource]:
    """A packaged set as manifest rows (``split``: train, test or all) and the source that fetches them.
    ``captions`` lists every phrasing of a row's caption: the text views poly-view objectives draw from."""
    import pandas as pd

    chosen = SPLITS if split == "all" else (split,)
    parts = [load_packaged(name, one) for one in chosen]
    frame = pd.DataFrame([row for part in parts for row in part.rows()])
    return frame, PackagedSource({(part.name, part.split): part.images for part in parts})


def packaged_source(sets: list[tuple[str, str]]) -> PackagedSource:
    """The source of the packaged sets ``sets`` ((name, split) pairs): what a manifest of packaged rows, as
    ``cloob data acquire`` writes for one, is fetched from."""
    return PackagedSource({key: load_packaged(*key).images for key in sets})
