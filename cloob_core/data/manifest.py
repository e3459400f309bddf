"""The reader: a manifest of image URLs and captions as one file or a folder (prefix) of parts, CSV, TSV, parquet or
JSONL, local or on S3, read part by part in batches of rows with only the columns that exist, never whole.

A folder's parts are its files in path order, recursively; names starting with ``_`` or ``.`` are skipped, as Spark
and Hadoop write them (``_SUCCESS``, ``_manifest.json``). A row's key is its zero-based row number over the parts in
order, so a re-run, a resumed run or a retry gives the same row the same key.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloob_core import storage
from cloob_core.errors import StageError

if TYPE_CHECKING:  # pandas and pyarrow are imported where a manifest is read, not in download workers
    import pandas as pd
    import pyarrow as pa

KEY_DIGITS = 9
BATCH_ROWS = 65_536
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_FORMATS = (((".csv",), "csv"), ((".tsv", ".tab"), "tsv"), ((".parquet", ".pq"), "parquet"),
            ((".jsonl", ".ndjson", ".json"), "jsonl"))


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
    """The ``index``-th of ``count`` contiguous ranges of the shards (a download pod's share: its shards lie in one
    or two parts of the manifest, so it reads few files)."""

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

    def shards(self, total: int) -> range:
        """Its shards among ``total``: ``[⌊i·total/n⌋, ⌊(i+1)·total/n⌋)``, so the ranges tile them in order."""
        return range(self.index * total // self.count, (self.index + 1) * total // self.count)

    @property
    def suffix(self) -> str:
        return "" if self.count == 1 else f".part-{self.index}-of-{self.count}"


@dataclass(frozen=True)
class SourcePart:
    """One file of a manifest: where it is, how to read it, and what tells whether it changed (its size and S3
    ETag, or locally its modification time)."""

    location: str
    kind: str
    compression: str | None
    size: int
    version: str

    @property
    def fingerprint(self) -> str:
        return f"{self.size}:{self.version}"


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
    for suffixes, kind in _FORMATS:
        if name.endswith(suffixes):
            return kind, compression
    raise ManifestError(
        f"cannot tell the format of {location!r} from its suffix; pass --input-format csv|tsv|parquet|jsonl"
    )


def _hidden(relative: str) -> bool:
    return any(piece.startswith(("_", ".")) for piece in relative.split("/"))


def list_parts(location: str, input_format: str = "auto") -> list[SourcePart]:
    """The parts of the manifest at ``location``: the file itself, or the files of the folder/prefix in path order
    (with ``input_format`` auto, only those whose suffix names a manifest format)."""
    location = str(location).rstrip("/") if str(location) != "/" else str(location)
    entries = storage.tree_entries(location)
    if not entries:
        single = storage.file_version(location)
        if single is None:
            raise ManifestError(f"manifest {location} does not exist (no file, and no folder with parts)")
        kind, compression = _format_of(location, input_format)
        return [SourcePart(location, kind, compression, *single)]
    parts = []
    for relative, size, version in entries:
        if _hidden(relative):
            continue
        try:
            kind, compression = _format_of(relative, input_format)
        except ManifestError:
            continue  # a README or a checksum file beside the parts
        parts.append(SourcePart(storage.join(location, *relative.split("/")), kind, compression, size, version))
    if not parts:
        raise ManifestError(f"manifest folder {location} holds no manifest parts (.parquet, .csv, .tsv, .jsonl, "
                            "optionally compressed; names starting with _ or . are skipped)")
    return parts


def _text_chunks(part: SourcePart, url_col: str, caption_col: str, batch_rows: int) -> Iterator[pd.DataFrame]:
    """A CSV/TSV part in frames of ``batch_rows``, all cells strings; a header-less first line that holds a URL
    is data (CC3M's caption<TAB>url files look like this)."""
    import pandas as pd

    sep = "," if part.kind == "csv" else "\t"
    options = dict(sep=sep, dtype=str, keep_default_na=False, compression=part.compression,
                   quoting=3 if sep == "\t" else 0, chunksize=batch_rows)
    with storage.open_seekable(part.location) as handle:
        header = pd.read_csv(handle, nrows=0, **{k: v for k, v in options.items() if k != "chunksize"})
        handle.seek(0)
        columns = [str(c) for c in header.columns]
        url_fields = [i for i, value in enumerate(columns) if _URL.match(value.strip())]
        if url_col in columns or not url_fields:
            yield from pd.read_csv(handle, **options)
            return
        names = [f"column_{i}" for i in range(len(columns))]
        names[url_fields[0]] = url_col
        if len(columns) == 2:
            names[1 - url_fields[0]] = caption_col
        yield from pd.read_csv(handle, header=None, names=names, **options)


def _arrow_batches(part: SourcePart, url_col: str, caption_col: str, batch_rows: int) -> Iterator[pa.Table]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if part.kind == "parquet":
        with storage.open_seekable(part.location) as handle:
            reader = pq.ParquetFile(handle)
            if reader.metadata.num_rows == 0:
                yield reader.schema_arrow.empty_table()
            for batch in reader.iter_batches(batch_size=batch_rows):
                yield pa.Table.from_batches([batch])
        return
    if part.kind == "jsonl":
        import pandas as pd

        with storage.open_seekable(part.location) as handle:
            for chunk in pd.read_json(handle, lines=True, dtype=False, compression=part.compression,
                                      chunksize=batch_rows):
                yield pa.Table.from_pandas(chunk, preserve_index=False)
        return
    for chunk in _text_chunks(part, url_col, caption_col, batch_rows):
        yield pa.Table.from_pandas(chunk, preserve_index=False)


def _normalised(table: pa.Table, url_col: str, caption_col: str) -> pa.Table:
    """``url`` and ``caption`` as strings: a missing value is empty, a URL loses surrounding whitespace."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for name, strip in ((url_col, True), (caption_col, False)):
        column = table.column(name)
        if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
            if pa.types.is_floating(column.type):  # a NaN is a missing value, as pandas wrote it
                column = pc.if_else(pc.is_nan(column), pa.scalar(None, column.type), column)
            column = pc.cast(column, pa.string()) if not pa.types.is_null(column.type) else \
                pa.nulls(len(column), pa.string())
        column = pc.fill_null(column, "")
        if strip:
            column = pc.utf8_trim_whitespace(column)
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return table


def read_batches(part: SourcePart, url_col: str = "url", caption_col: str = "caption",
                 batch_rows: int = BATCH_ROWS) -> Iterator[pa.Table]:
    """The rows of one part in order, as arrow tables of at most ``batch_rows`` rows with string ``url`` and
    ``caption`` columns (see :func:`_normalised`) plus every other column; a malformed part is a
    :class:`ManifestError` naming it."""
    try:
        for table in _arrow_batches(part, url_col, caption_col, batch_rows):
            missing = [col for col in (url_col, caption_col) if col not in table.column_names]
            if missing:
                raise ManifestError(
                    f"manifest {part.location} has no column(s) {missing}; columns found: {table.column_names} "
                    "(choose them with --url-col / --caption-col)")
            yield _normalised(table, url_col, caption_col)
    except (ManifestError, FileNotFoundError):
        raise
    except Exception as err:  # pandas/pyarrow raise many types for malformed files
        raise ManifestError(f"manifest {part.location} is not valid {part.kind}: {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}") from None


def read_manifest(location: str, url_col: str = "url", caption_col: str = "caption",
                  input_format: str = "auto") -> pd.DataFrame:
    """A small manifest (an evaluation set's labels, a local folder's list) as one frame. The data path never
    calls this: it reads parts in batches (:func:`read_batches`)."""
    import pandas as pd

    tables = [table.to_pandas() for part in list_parts(location, input_format)
              for table in read_batches(part, url_col, caption_col)]
    if not tables:
        return pd.DataFrame({url_col: [], caption_col: []}, dtype=str)
    return pd.concat(tables, ignore_index=True)


def jsonable(value: Any) -> Any:
    """A cell as JSON: what a sample's ``.json`` carries of the manifest's other columns."""
    if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0) == 1:
        return [jsonable(v) for v in value]  # e.g. a column of caption lists, from parquet or JSONL
    if value is None or (isinstance(value, float) and math.isnan(value)):
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


# One rule for a table that names local files (`data shards --manifest`, `data eval-set`, an `eval` captions CSV): a
# relative path is read from the table's own folder (as Hugging Face's ImageFolder reads its metadata.csv), an
# absolute one as it is.
def table_folder(table: str | Path) -> Path:
    """The folder a table's relative paths are read from: the table's own (a folder of parts: that folder)."""
    table = Path(table).resolve()
    return table if table.is_dir() else table.parent


def table_file(table: str | Path, value: str, column: str, row: int, inside: Path | None = None) -> Path:
    """The file that row ``row`` (1-based) of ``table`` names in ``column``, by the one rule; a one-line
    :class:`ManifestError` naming the table, row and column when it is empty, not a file, or outside ``inside``."""
    where = f"{table}, row {row}, column {column!r}"
    if not str(value or "").strip():
        raise ManifestError(f"{where}: no path")
    base = table_folder(table)
    path = (base / str(value)).resolve()
    if inside is not None and not path.is_relative_to(inside.resolve()):
        raise ManifestError(f"{where}: {value!r} is outside {inside.resolve()}")
    if not path.is_file():
        raise ManifestError(f"{where}: {value!r} is not a file ({path}); relative paths in a table are read from "
                            f"the table's own folder, {base}")
    return path
