"""The run's manifest, as ``cloob data acquire`` writes it: a folder of parquet parts, one per part of the source,
each cut into row groups of whole shards, and beside them

- ``_manifest.json``, the index: the parts in order (rows, row groups, content digest, the source part and its
  fingerprint), the URL and caption columns, the packaged sets its rows name;
- ``_url_duplicates-<digest>.parquet``: ``(row, first)`` for each row whose URL an earlier row has, sorted by row,
  computed out of core by the engine.

Every file but the index is named by its content (or its source's), and the index is written last and names
every file, so a kill leaves the previous manifest whole: files of these names that the index does not name (the
old index's, or a killed run's) are removed only after the new index is in place. Every later step
reads the index (its size grows with the parts, not the rows) and the row groups it needs. The parts keep the
source's names and order, and a part whose source is unchanged (same size and ETag, or locally
:func:`cloob_core.storage.local_version`) is reused, so a
growing source re-reads only its new parts; rows keep their numbers when parts are added at the end.
A shard never spans two parts: a part's shards are its own, so adding a part adds shards and changes none.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cloob_core import conditional_write, lease, scratch, storage
from cloob_core.config import EngineConfig
from cloob_core.data import engine
from cloob_core.data.manifest import ManifestError, ManifestRow, jsonable
from cloob_core.data.packaged import PREFIX as PACKAGED_PREFIX
from cloob_core.data.packaged import parse_url
from cloob_core.io import json_bytes, remove_temporaries

if TYPE_CHECKING:
    import pyarrow as pa

INDEX_NAME = "_manifest.json"
DUPLICATES_STEM = "_url_duplicates"  # _url_duplicates-<digest>.parquet
DUPLICATES_NAME = f"{DUPLICATES_STEM}.parquet"  # a scratch name while it is written
LEGACY_DUPLICATES = DUPLICATES_NAME  # the fixed name indexes written before the digest name had
LAYOUT = 1


@dataclass(frozen=True)
class ManifestPart:
    name: str
    rows: int
    row_groups: tuple[int, ...]
    sha256: str
    source: str
    source_fingerprint: str | None
    packaged: tuple[tuple[str, str], ...] = ()  # the packaged sets its rows name (packaged:NAME/SPLIT/INDEX)
    packaged_rows: int = 0


@dataclass(frozen=True)
class Shard:
    """Shard ``number``: rows ``[first_row, first_row + rows)`` of the manifest, all in part ``part``."""

    number: int
    part: int
    first_row: int
    rows: int


@dataclass(frozen=True)
class RunManifest:
    location: str
    url_col: str
    caption_col: str
    parts: tuple[ManifestPart, ...]
    duplicate_rows: int = 0
    duplicates: str = LEGACY_DUPLICATES  # the URL duplicates' file, named by its content
    _open: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)
    _last_read: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def open(cls, location: str) -> RunManifest:
        """The run manifest at ``location`` (a folder that ``cloob data acquire`` wrote)."""
        location = str(location)
        try:
            index = storage.read_json(storage.join(location, INDEX_NAME))
        except FileNotFoundError:
            raise ManifestError(f"{location} is not a run manifest (no {INDEX_NAME}); `cloob data acquire` "
                                "writes one from any manifest") from None
        if index.get("layout") != LAYOUT:
            raise ManifestError(f"{location}: run manifest layout {index.get('layout')!r} is not {LAYOUT}; "
                                "acquire it again")
        parts = tuple(ManifestPart(**{**part, "row_groups": tuple(part["row_groups"]),
                                      "packaged": tuple(tuple(pair) for pair in part["packaged"])})
                      for part in index["parts"])
        return cls(location, index["url_col"], index["caption_col"], parts, index["duplicate_rows"],
                   index.get("duplicates", LEGACY_DUPLICATES))

    @staticmethod
    def is_one(location: str) -> bool:
        return storage.exists(storage.join(str(location), INDEX_NAME))

    def __len__(self) -> int:
        return sum(part.rows for part in self.parts)

    @property
    def packaged(self) -> list[tuple[str, str]]:
        """The packaged sets its rows name, whose images the download takes from the package."""
        return sorted({pair for part in self.parts for pair in part.packaged})

    @property
    def all_packaged(self) -> bool:
        """Whether every row is a packaged set's (what ``cloob data acquire`` writes for one)."""
        return bool(self.parts) and all(part.packaged_rows == part.rows for part in self.parts)

    @property
    def first_rows(self) -> list[int]:
        """The manifest row of each part's first row."""
        starts, total = [], 0
        for part in self.parts:
            starts.append(total)
            total += part.rows
        return starts

    def fingerprint(self) -> str:
        """sha256 over the parts' digests in order: what the rows are, from the index alone."""
        digest = hashlib.sha256()
        for part in self.parts:
            digest.update(f"{part.rows}:{part.sha256}\n".encode())
        return digest.hexdigest()

    def part_fingerprints(self) -> list[str]:
        return [f"{part.rows}:{part.sha256}" for part in self.parts]

    def shards(self, shard_size: int) -> Iterator[Shard]:
        """Every shard in order: each part cut into ``shard_size`` rows, its last shard shorter."""
        number = 0
        for index, (part, start) in enumerate(zip(self.parts, self.first_rows, strict=True)):
            for offset in range(0, part.rows, shard_size):
                yield Shard(number, index, start + offset, min(shard_size, part.rows - offset))
                number += 1

    def shard_count(self, shard_size: int) -> int:
        return sum(math.ceil(part.rows / shard_size) for part in self.parts)

    def rows(self, indices: list[int]) -> list[ManifestRow]:
        """The manifest rows ``indices`` (ascending), reading only the row groups that hold them."""
        starts = self.first_rows
        by_part: dict[int, list[int]] = {}
        for row in indices:
            part = bisect.bisect_right(starts, row) - 1
            if part < 0 or row >= starts[part] + self.parts[part].rows:
                raise ManifestError(f"{self.location} has no row {row}")
            by_part.setdefault(part, []).append(row - starts[part])
        found: list[ManifestRow] = []
        for part, positions in by_part.items():
            found += self._rows_of_part(part, positions, starts[part])
        return found

    def _rows_of_part(self, index: int, positions: list[int], base: int) -> list[ManifestRow]:
        import pyarrow as pa

        part = self.parts[index]
        group_starts = [0]
        for size in part.row_groups:
            group_starts.append(group_starts[-1] + size)
        wanted = sorted({_group_of(group_starts, p) for p in positions})
        table = self._row_groups(index, wanted)
        first_of = {group: sum(part.row_groups[g] for g in wanted if g < group) for group in wanted}
        take = [first_of[g] + p - group_starts[g] for p in positions for g in (_group_of(group_starts, p),)]
        table = table.take(pa.array(take, pa.int64()))
        extras = [name for name in table.column_names if name not in (self.url_col, self.caption_col)]
        urls, captions = table.column(self.url_col).to_pylist(), table.column(self.caption_col).to_pylist()
        extra_values = {name: table.column(name).to_pylist() for name in extras}
        return [ManifestRow(base + p, urls[i], captions[i], {name: jsonable(extra_values[name][i]) for name in extras})
                for i, p in enumerate(positions)]

    def _row_groups(self, index: int, wanted: list[int]) -> pa.Table:
        """Row groups ``wanted`` of part ``index``; the last ones read are kept, since consecutive shards
        smaller than a row group share it."""
        key = (index, tuple(wanted))
        if self._last_read.get("key") != key:
            self._last_read.update(key=key, table=self._parquet(index).read_row_groups(wanted))
        return self._last_read["table"]

    def _parquet(self, index: int) -> Any:
        """The open parquet reader of part ``index``; one part open at a time (a partition reads in order)."""
        import pyarrow.parquet as pq

        if index not in self._open:
            for handle in self._open.values():
                handle.close()
            self._open.clear()
            self._open[index] = pq.ParquetFile(storage.open_seekable(storage.join(self.location,
                                                                                  self.parts[index].name)))
        return self._open[index]

    def duplicates_between(self, first: int, stop: int) -> dict[int, int]:
        """``{row: first row with its URL}`` for the repeated URLs among rows ``[first, stop)``."""
        import pyarrow.parquet as pq

        if not self.duplicate_rows:
            return {}
        with storage.open_seekable(storage.join(self.location, self.duplicates)) as handle:
            table = pq.read_table(handle, filters=[("row", ">=", first), ("row", "<", stop)])
        return dict(zip(table.column("row").to_pylist(), table.column("first").to_pylist(), strict=True))

    def close(self) -> None:
        for handle in self._open.values():
            handle.close()
        self._open.clear()
        self._last_read.clear()


def _group_of(group_starts: list[int], position: int) -> int:
    return bisect.bisect_right(group_starts, position) - 1


@dataclass(frozen=True)
class PartSource:
    """What acquire turns into one part: its name in the source, what tells a change, and its rows."""

    source: str
    fingerprint: str | None  # None: never reused (a packaged set, small and rebuilt from the package)
    batches: Any  # () -> Iterator[pa.Table]


def frame_part(source: str, frame: Any) -> PartSource:
    """A small in-memory table (a packaged set, a local folder's list) as one part, written again each run (no
    fingerprint)."""
    def batches() -> Iterator[pa.Table]:
        import pyarrow as pa

        yield pa.Table.from_pandas(frame, preserve_index=False)

    return PartSource(source, None, batches)


def part_name(source: PartSource) -> str:
    """The written part's name: a digest of where it came from and what it was then, so a changed source part gets
    a new file and an unchanged one keeps its own."""
    return f"part-{hashlib.sha256(f'{source.source}|{source.fingerprint}'.encode()).hexdigest()[:16]}.parquet"


def write_run_manifest(sources: Iterable[PartSource], output: str, url_col: str, caption_col: str,
                       row_group_rows: int, settings: EngineConfig) -> RunManifest:
    """Write (or bring up to date) the run manifest at ``output`` from ``sources`` in order; see the module
    docstring. Parts already there from the same source and fingerprint are kept as they are. Every file is
    published under the output's lease (:func:`cloob_core.lease.check_held`), and on S3 the index only over the
    index this run started from: a run that lost its lease, or whose output another run replaced, publishes
    nothing more."""
    storage.ensure_folder(output)
    if not storage.is_s3(output):  # a killed run's half-written files (an S3 object appears only whole)
        remove_temporaries(output, lambda name: name == INDEX_NAME or bool(_OUR_FILES.fullmatch(name)))
    index_location = storage.join(output, INDEX_NAME)
    started_from = conditional_write.read_versioned(index_location)[1] if storage.is_s3(output) else None
    previous = _previous(output)
    with scratch.folder("cloob-acquire") as staging:
        parts = []
        for source in sources:
            name = part_name(source)
            kept = next((part for part in previous.parts if part.name == name), None) if previous else None
            if kept is not None and source.fingerprint is not None and storage.exists(storage.join(output, name)):
                parts.append(kept)
                continue
            local = staging / name
            written = _write_part(source.batches(), local, url_col, caption_col, row_group_rows)
            parts.append(ManifestPart(name, written.rows, written.row_groups, _sha256(local), source.source,
                                      source.fingerprint, tuple(sorted(written.packaged)), written.packaged_rows))
            lease.check_held(output)
            storage.upload_file(local, storage.join(output, name))
            local.unlink(missing_ok=True)
        manifest = RunManifest(output, url_col, caption_col, tuple(parts))
        local = staging / DUPLICATES_NAME
        duplicate_rows = _write_duplicates(manifest, local, settings)
        duplicates = duplicates_name(_sha256(local))  # named by content: the index it belongs to names it
        lease.check_held(output)
        storage.upload_file(local, storage.join(output, duplicates))
        manifest = RunManifest(output, url_col, caption_col, tuple(parts), duplicate_rows, duplicates)
        lease.check_held(output)
        if storage.is_s3(output):
            try:
                conditional_write.write_if_unchanged(index_location, json_bytes(_index(manifest)), started_from)
            except conditional_write.WriteConflict:
                raise lease.LeaseLost(f"{index_location} was replaced by another run while this one wrote "
                                      f"{output}; its index stands, and this run published nothing; run it again "
                                      "if that run was not meant to") from None
        else:
            storage.write_bytes(index_location, json_bytes(_index(manifest)))
    in_use = {part.name for part in parts} | {duplicates}
    for name in storage.list_names(output, ".parquet"):
        if _OUR_FILES.fullmatch(name) and name not in in_use:  # an older index's, also one a killed run left
            storage.delete(storage.join(output, name))
    return manifest


_OUR_FILES = re.compile(r"part-[0-9a-f]{16}\.parquet|_url_duplicates(-[0-9a-f]{16})?\.parquet")


def duplicates_name(digest: str) -> str:
    return f"{DUPLICATES_STEM}-{digest[:16]}.parquet"


def _index(manifest: RunManifest) -> dict[str, Any]:
    return {"layout": LAYOUT, "url_col": manifest.url_col, "caption_col": manifest.caption_col,
            "rows": len(manifest), "fingerprint": manifest.fingerprint(), "duplicate_rows": manifest.duplicate_rows,
            "duplicates": manifest.duplicates,
            "parts": [{**asdict(part), "row_groups": list(part.row_groups),
                       "packaged": [list(pair) for pair in part.packaged]} for part in manifest.parts]}


def _previous(output: str) -> RunManifest | None:
    if not RunManifest.is_one(output):
        return None
    try:
        return RunManifest.open(output)
    except ManifestError:
        return None


@dataclass
class _Written:
    row_groups: tuple[int, ...] = ()
    packaged: set[tuple[str, str]] = field(default_factory=set)
    packaged_rows: int = 0

    @property
    def rows(self) -> int:
        return sum(self.row_groups)


def _write_part(batches: Iterator[pa.Table], local: Path, url_col: str, caption_col: str,
                row_group_rows: int) -> _Written:
    """Stream ``batches`` into one parquet file of row groups of ``row_group_rows``."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    writer, schema, pending, groups, written = None, None, [], [], _Written()
    try:
        for table in batches:
            if schema is None:
                schema = _writable_schema(table.schema)
                writer = pq.ParquetWriter(local, schema, compression="zstd")
            table = _conform(table, schema, local.name)
            urls = table.column(url_col)
            marked = pc.starts_with(urls, PACKAGED_PREFIX)
            if pc.any(marked).as_py():
                written.packaged_rows += pc.sum(marked).as_py()
                written.packaged |= {parse_url(url)[:2] for url in pc.unique(pc.filter(urls, marked)).to_pylist()}
            pending.append(table)
            buffered = pa.concat_tables(pending)
            while buffered.num_rows >= row_group_rows:
                writer.write_table(buffered.slice(0, row_group_rows), row_group_size=row_group_rows)
                groups.append(row_group_rows)
                buffered = buffered.slice(row_group_rows)
            pending = [buffered]
        if writer is None:
            schema = pa.schema([(url_col, pa.string()), (caption_col, pa.string())])
            writer = pq.ParquetWriter(local, schema, compression="zstd")
        rest = pa.concat_tables(pending) if pending else None
        if rest is not None and rest.num_rows:
            writer.write_table(rest, row_group_size=row_group_rows)
            groups.append(rest.num_rows)
    finally:
        if writer is not None:
            writer.close()
    written.row_groups = tuple(groups)
    return written


def _writable_schema(schema: pa.Schema) -> pa.Schema:
    """The first batch's schema, with columns of no known type (all missing so far) as strings."""
    import pyarrow as pa

    return pa.schema([pa.field(f.name, pa.string()) if pa.types.is_null(f.type) else f.remove_metadata()
                      for f in schema]).remove_metadata()


def _conform(table: pa.Table, schema: pa.Schema, name: str) -> pa.Table:
    """``table`` in ``schema``'s columns and types: a column missing from a batch is all missing; a column that
    appears only later, or changes type, is an error naming it."""
    import pyarrow as pa

    extra = [column for column in table.column_names if column not in schema.names]
    if extra:
        raise ManifestError(f"{name}: column(s) {extra} appear only after the first rows of this part; give every "
                            "row the same columns")
    columns = []
    for target in schema:
        if target.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, target.type))
            continue
        column = table.column(target.name)
        try:
            columns.append(column if column.type == target.type else column.cast(target.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise ManifestError(f"column {target.name!r} changes type within a part ({target.type} first, "
                                f"{column.type} later)") from None
    return pa.Table.from_arrays(columns, schema=schema)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _write_duplicates(manifest: RunManifest, local: Path, settings: EngineConfig) -> int:
    """``(row, first)`` for each row whose URL an earlier row has, sorted by row, out of core; the row count."""
    locations = [storage.join(manifest.location, part.name) for part in manifest.parts]
    url = engine.quoted(manifest.url_col)
    with engine.connect(settings, locations) as db:
        db.execute("CREATE TEMP TABLE bases (filename VARCHAR, base BIGINT)")
        if locations:
            db.executemany("INSERT INTO bases VALUES (?, ?)", list(zip(locations, manifest.first_rows, strict=True)))
            rows = f"""SELECT r.{url} AS url, b.base + r.file_row_number AS row
                       FROM read_parquet(?, filename = true, file_row_number = true) r JOIN bases b USING (filename)"""
        else:
            rows, locations = "SELECT NULL::VARCHAR AS url, NULL::BIGINT AS row WHERE false", None
        query = f"""COPY (
            WITH rows AS ({rows}),
                 firsts AS (SELECT url, min(row) AS first FROM rows GROUP BY url HAVING count(*) > 1)
            SELECT rows.row, firsts.first FROM rows JOIN firsts USING (url) WHERE rows.row <> firsts.first
            ORDER BY rows.row
        ) TO '{_sql_text(str(local))}' (FORMAT parquet, ROW_GROUP_SIZE 65536)"""
        db.execute(query, [locations] if locations else [])
    import pyarrow.parquet as pq

    return pq.ParquetFile(local).metadata.num_rows


def _sql_text(text: str) -> str:
    return text.replace("'", "''")
