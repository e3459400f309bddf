"""The reader: a manifest of image URLs and captions, as CSV, TSV, parquet or JSONL, local or on S3.

Rows keep their position in the manifest: a row's key is its zero-based row number, so a re-run, a resumed
run or a retry gives the same row the same key, and shard ``k`` always holds rows ``[k*S, (k+1)*S)``.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cloob_core import storage
from cloob_core.errors import StageError

if TYPE_CHECKING:  # pandas is imported where a manifest is read, not in download workers
    import pandas as pd

KEY_DIGITS = 9
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


class ManifestError(StageError, ValueError):
    """A manifest that cannot be read as asked: the message says what was found."""


def row_key(row: int) -> str:
    return f"{row:0{KEY_DIGITS}d}"


@dataclass(frozen=True)
class ManifestRow:
    row: int
    url: str
    caption: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return row_key(self.row)


@dataclass(frozen=True)
class Partition:
    """The ``index``-th of ``count`` disjoint parts; shard ``k`` belongs to part ``k % count``."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Partition:
        match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
        if not match:
            raise ManifestError(f"--partition must look like i/n (e.g. 0/4), got {text!r}")
        index, count = int(match.group(1)), int(match.group(2))
        if count < 1 or not 0 <= index < count:
            raise ManifestError(f"--partition {text}: need 0 <= i < n")
        return cls(index, count)

    def owns(self, shard: int) -> bool:
        return shard % self.count == self.index

    @property
    def suffix(self) -> str:
        return "" if self.count == 1 else f".part-{self.index}-of-{self.count}"


def _format_of(location: str, requested: str) -> tuple[str, str | None]:
    """(format, compression); a ``.parquet`` file is parquet whatever ``requested`` says (no text reader reads
    it): so the acquired manifest reads back under the input_format of the user's CSV or TSV source."""
    name = location.lower()
    compression = None
    for ext, kind in ((".gz", "gzip"), (".bz2", "bz2"), (".zst", "zstd"), (".xz", "xz")):
        if name.endswith(ext):
            name, compression = name[: -len(ext)], kind
    if requested != "auto" and not name.endswith((".parquet", ".pq")):
        return requested, compression
    for suffixes, kind in (
        ((".csv",), "csv"),
        ((".tsv", ".tab"), "tsv"),
        ((".parquet", ".pq"), "parquet"),
        ((".jsonl", ".ndjson", ".json"), "jsonl"),
    ):
        if name.endswith(suffixes):
            return kind, compression
    raise ManifestError(
        f"cannot tell the format of {location!r} from its suffix; pass --input-format csv|tsv|parquet|jsonl"
    )


def _read_delimited(raw: bytes, sep: str, compression: str | None, url_col: str, caption_col: str) -> pd.DataFrame:
    import pandas as pd

    options = dict(sep=sep, dtype=str, keep_default_na=False, compression=compression, quoting=3 if sep == "\t" else 0)
    frame = pd.read_csv(io.BytesIO(raw), **options)
    if url_col in frame.columns or frame.empty:
        return frame
    first = [str(c) for c in frame.columns]
    url_fields = [i for i, value in enumerate(first) if _URL.match(value.strip())]
    if not url_fields:
        return frame  # a header without the URL column: reported by the caller with the columns found
    # No header: the first line is data (CC3M's caption<TAB>url files look like this).
    frame = pd.read_csv(io.BytesIO(raw), header=None, **options)
    names = [f"column_{i}" for i in range(frame.shape[1])]
    names[url_fields[0]] = url_col
    if frame.shape[1] == 2:
        names[1 - url_fields[0]] = caption_col
    frame.columns = names
    return frame


def read_manifest(location: str | os.PathLike, url_col: str = "url", caption_col: str = "caption",
                  input_format: str = "auto") -> pd.DataFrame:
    """The manifest as a frame with string ``url`` and ``caption`` columns plus any extra columns."""
    import pandas as pd

    location = str(location)
    kind, compression = _format_of(location, input_format)
    try:
        raw = storage.read_bytes(location)
    except FileNotFoundError:
        raise ManifestError(f"manifest {location} does not exist") from None
    try:
        if kind in ("csv", "tsv"):
            frame = _read_delimited(raw, "," if kind == "csv" else "\t", compression, url_col, caption_col)
        elif kind == "parquet":
            frame = pd.read_parquet(io.BytesIO(raw))
        else:
            frame = pd.read_json(io.BytesIO(raw), lines=True, dtype=False, compression=compression)
    except ManifestError:
        raise
    except Exception as err:  # pandas/pyarrow raise many types for malformed files
        raise ManifestError(f"manifest {location} is not valid {kind}: {type(err).__name__}: {err}") from None
    missing = [col for col in (url_col, caption_col) if col not in frame.columns]
    if missing:
        raise ManifestError(
            f"manifest {location} has no column(s) {missing}; columns found: {[str(c) for c in frame.columns]} "
            "(choose them with --url-col / --caption-col)"
        )
    frame = frame.reset_index(drop=True)
    frame[url_col] = frame[url_col].map(lambda v: "" if _missing(v) else str(v).strip())
    frame[caption_col] = frame[caption_col].map(lambda v: "" if _missing(v) else str(v))
    return frame


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1:
        return [_jsonable(v) for v in value]  # e.g. a column of caption lists, from parquet or JSONL
    if _missing(value):
        return None
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (ValueError, AttributeError):
            pass
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value


class Manifest:
    """Row access by range, plus the first row of every URL (for fetching a repeated URL once)."""

    def __init__(self, frame: pd.DataFrame, url_col: str, caption_col: str):
        import pandas as pd

        self.frame = frame
        self.url_col = url_col
        self.caption_col = caption_col
        self.extra_cols = [c for c in frame.columns if c not in (url_col, caption_col)]
        positions = pd.Series(range(len(frame)), index=frame.index)
        self.first_row_of_url = positions.groupby(frame[url_col].values).transform("min").to_numpy()

    @classmethod
    def load(cls, location: str | os.PathLike, url_col: str = "url", caption_col: str = "caption",
             input_format: str = "auto") -> Manifest:
        return cls(read_manifest(location, url_col, caption_col, input_format), url_col, caption_col)

    def __len__(self) -> int:
        return len(self.frame)

    def rows(self, indices: list[int] | range) -> list[ManifestRow]:
        part = self.frame.iloc[list(indices)]
        urls = part[self.url_col].tolist()
        captions = part[self.caption_col].tolist()
        extras = part[self.extra_cols].to_dict("records") if self.extra_cols else [{}] * len(part)
        return [
            ManifestRow(int(i), u, c, {str(k): _jsonable(v) for k, v in e.items()})
            for i, u, c, e in zip(indices, urls, captions, extras, strict=True)
        ]

    def fingerprint(self) -> str:
        """sha256 over the URLs and captions in order: tells whether a resume sees the same manifest."""
        import hashlib

        import pandas as pd

        hashes = pd.util.hash_pandas_object(self.frame[[self.url_col, self.caption_col]], index=False)
        return hashlib.sha256(hashes.to_numpy().tobytes()).hexdigest()

    def shard_count(self, shard_size: int) -> int:
        return math.ceil(len(self) / shard_size)
