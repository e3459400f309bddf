"""The score table `cloob data score` writes and `cloob data curate` reads: its layout, its columns, its records.

A scores folder ``O`` holds, per shard ``NAME.tar`` of the pool (DataComp's layout: a parquet of the samples' facts
and scores, and the embeddings in the same row order):

- ``parts/NAME.parquet``: one row per readable sample, in the shard's order (:data:`SCHEMA`);
- ``parts/NAME.npz``: ``image`` and ``text``, ``[rows, d]`` float16, unit norm before the cast; read with
  ``allow_pickle=False``;
- ``parts/NAME.json``: the part's record (:class:`PartRecord`), written after the two files: what was scored
  (the shard's size and version, the model's fingerprint) and the two files' SHA-256. A part without it is not
  done, and one whose shard has changed since is scored again.

and ``scores.json`` (:class:`ScoreIndex`), written last, once every shard of the pool has its part: the model, the
pool's fingerprint and each part's record. Readers read the parts through the index and check each file's digest
as they read it, so a part changed or cut after the index was written is named, never read as scores.

Why not one :mod:`cloob_core.publish` unit: a pool of 10^5 shards is scored by several pods over hours, and a
killed or grown run adds parts to what is there; a unit is staged and switched whole. The index plays the unit
record's part (the members and their digests), the per-part records the part of a resume's plan.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from cloob_core import storage
from cloob_core.errors import StageError
from cloob_core.io import json_bytes, parse_json

INDEX_FILE = "scores.json"
PARTS = "parts"
FORMAT = "cloob-scores/1"
# the definition of the facts cloob_core.curation.facts computes, recorded in every part: 2 is lid.176 on the
# caption in lower case without punctuation, Han without kana as Chinese, and Han and kana characters as words
FACTS = "facts/2"
EMBEDDINGS = ("image", "text")  # the arrays of a part's npz
_READ_BLOCK = 8 << 20


class ScoresError(StageError):
    """Scores that cannot be used: missing, damaged, or made of other shards or by another model."""


# the score table's columns and their Arrow types, in order
_FIELDS = (("key", "string"), ("shard", "string"), ("position", "int32"), ("url", "string"), ("caption", "string"),
           ("sha256", "string"), ("clip_score", "float32"), ("caption_words", "int32"), ("caption_chars", "int32"),
           ("language", "string"), ("language_confidence", "float32"), ("phash", "uint64"), ("width", "int32"),
           ("height", "int32"))
COLUMNS = tuple(name for name, _ in _FIELDS)


def schema() -> Any:
    """The score table's Arrow schema."""
    import pyarrow as pa

    return pa.schema([(name, pa.type_for_alias(kind)) for name, kind in _FIELDS])


@dataclass(frozen=True)
class ModelStamp:
    """Which model scored: its weights' fingerprint, its architecture (as named) and the digest of its open_clip
    configuration, and the precision it ran at. Two stamps are one model by content (:meth:`same_model`): the
    same weights and configuration however the model was spelled (``local-dir:runs/m/model``, ``runs/m/model``,
    its absolute path, ``hf-hub:`` of the same push)."""

    fingerprint: str
    architecture: str
    precision: str
    config: str | None = None  # None: a record from before the configuration's digest was kept

    def same_model(self, other: ModelStamp) -> bool:
        if self.fingerprint != other.fingerprint:
            return False
        if self.config is not None and other.config is not None:
            return self.config == other.config
        return self.architecture == other.architecture


@dataclass(frozen=True)
class PartRecord:
    """One shard's part: the shard as it was scored, what came of it, and its files' digests."""

    name: str  # the shard's file name without .tar: the part's files' stem
    shard_size: int | None  # bytes, from the shard folder's listing (None: a location storage cannot list)
    shard_version: str | None
    rows: int
    unreadable: int | None  # samples sizes.json counts that did not read (None: no sizes.json)
    width: int  # the embeddings' (0 for a part without rows)
    model: ModelStamp
    table_sha256: str
    embeddings_sha256: str
    table_bytes: int | None = None  # the files' sizes (None: a record from before they were kept)
    embeddings_bytes: int | None = None
    facts: str = "facts/1"  # the facts' definition (FACTS; a record without it: the first)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def files_match(self, scores: str, sizes: dict[str, int]) -> bool:
        """Whether the part's two files are there as this record has them: by their sizes in ``sizes`` (a listing
        of the parts folder: no file read), or, for a record without sizes, by their digests."""
        table, embeddings = f"{self.name}.parquet", f"{self.name}.npz"
        if self.table_bytes is not None and self.embeddings_bytes is not None:
            return sizes.get(table) == self.table_bytes and sizes.get(embeddings) == self.embeddings_bytes
        try:
            check_part_file(part_file(scores, self.name, ".parquet"), self.table_sha256)
            check_part_file(part_file(scores, self.name, ".npz"), self.embeddings_sha256)
        except ScoresError:
            return False
        return True

    @classmethod
    def from_json(cls, data: Any, where: str) -> PartRecord:
        try:
            return cls(**{**data, "model": ModelStamp(**data["model"])})
        except (TypeError, KeyError) as err:
            raise ScoresError(f"{where} is not a part record of `cloob data score` ({err})") from None


@dataclass(frozen=True)
class ScoreIndex:
    """A scored pool: the model, the pool's fingerprint, the embeddings' width and every part, in shard order."""

    model: ModelStamp
    shards_fingerprint: str
    embedding_width: int
    parts: list[PartRecord] = field(default_factory=list)
    format: str = FORMAT

    @property
    def rows(self) -> int:
        return sum(part.rows for part in self.parts)

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "model": asdict(self.model), "shards_fingerprint": self.shards_fingerprint,
                "embedding_width": self.embedding_width, "rows": self.rows,
                "parts": [part.to_json() for part in self.parts]}


def part_file(scores: str, name: str, suffix: str) -> str:
    return storage.join(scores, PARTS, f"{name}{suffix}")


def read_part_record(scores: str, name: str) -> PartRecord | None:
    """The record of shard ``name``'s part, or None where there is none (not scored, or killed before it)."""
    location = part_file(scores, name, ".json")
    try:
        data = parse_json(storage.read_bytes(location), location)
    except FileNotFoundError:
        return None
    return PartRecord.from_json(data, location)


def part_sizes(scores: str) -> dict[str, int]:
    """The size of every file of the scores folder's parts, by file name: one listing."""
    return {name: size for name, size, _ in storage.tree_entries(storage.join(scores, PARTS)) if "/" not in name}


def write_part(scores: str, record_of: Any, table: Any, image: np.ndarray, text: np.ndarray) -> PartRecord:
    """Write a part's table and embeddings, then its record (``record_of(table_sha256, embeddings_sha256,
    table_bytes, embeddings_bytes)``), each atomically: a part is done once its record is there and its files
    match it."""
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    table_bytes = buffer.getvalue()
    buffer = io.BytesIO()
    np.savez(buffer, image=image.astype(np.float16), text=text.astype(np.float16))
    embedding_bytes = buffer.getvalue()
    record: PartRecord = record_of(hashlib.sha256(table_bytes).hexdigest(), hashlib.sha256(embedding_bytes).hexdigest(),
                                   len(table_bytes), len(embedding_bytes))
    storage.write_bytes(part_file(scores, record.name, ".parquet"), table_bytes)
    storage.write_bytes(part_file(scores, record.name, ".npz"), embedding_bytes)
    write_part_record(scores, record)
    return record


def write_part_record(scores: str, record: PartRecord) -> None:
    """A part's record, written last (atomically): the part is done once it is there."""
    storage.write_bytes(part_file(scores, record.name, ".json"), json_bytes(record.to_json()))


def write_index(scores: str, index: ScoreIndex) -> None:
    storage.write_bytes(storage.join(scores, INDEX_FILE), json_bytes(index.to_json()))


def read_index(scores: str) -> ScoreIndex:
    """The index of the scores folder ``scores``; a folder without one (scoring not finished) is one line."""
    location = storage.join(scores, INDEX_FILE)
    try:
        data = parse_json(storage.read_bytes(location), location)
    except FileNotFoundError:
        raise ScoresError(f"{scores} holds no {INDEX_FILE}: its scoring has not finished (run `cloob data score` "
                          "again with the same --output: it scores only the shards it lacks)") from None
    try:
        if data.get("format") != FORMAT:
            raise ScoresError(f"{location} is not a `cloob data score` index (format {data.get('format')!r})")
        return ScoreIndex(ModelStamp(**data["model"]), str(data["shards_fingerprint"]), int(data["embedding_width"]),
                          [PartRecord.from_json(part, location) for part in data["parts"]])
    except (AttributeError, TypeError, KeyError, ValueError) as err:
        raise ScoresError(f"{location} is damaged ({type(err).__name__}: {err})") from None


def _missing(location: str) -> ScoresError:
    return ScoresError(f"{location} is missing: the scores are incomplete (score the pool again into the same "
                       "--output: only the parts it lacks are scored)")


def _changed(location: str) -> ScoresError:
    return ScoresError(f"{location} does not match the digest its index records: it changed or was cut after it "
                       "was scored (delete it and score the pool again into the same --output: a part whose files "
                       "are not there is scored again)")


def check_part_file(location: str, digest: str) -> None:
    """The part file at ``location`` has the SHA-256 ``digest``, read in blocks (a part may be large)."""
    found = hashlib.sha256()
    try:
        with storage.open_read(location) if storage.is_s3(location) else open(location, "rb") as handle:
            while block := handle.read(_READ_BLOCK):
                found.update(block)
    except FileNotFoundError:
        raise _missing(location) from None
    if found.hexdigest() != digest:
        raise _changed(location)


def _checked_bytes(scores: str, record: PartRecord, suffix: str, digest: str) -> bytes:
    location = part_file(scores, record.name, suffix)
    try:
        data = storage.read_bytes(location)
    except FileNotFoundError:
        raise _missing(location) from None
    if hashlib.sha256(data).hexdigest() != digest:
        raise _changed(location)
    return data


def read_part_table(scores: str, record: PartRecord) -> Any:
    """A part's table (pyarrow), its bytes checked against the record."""
    import pyarrow.parquet as pq

    data = _checked_bytes(scores, record, ".parquet", record.table_sha256)
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as err:  # pyarrow's errors for a file that is not parquet
        raise ScoresError(f"{part_file(scores, record.name, '.parquet')} is not readable parquet ({err})") from None
    if table.num_rows != record.rows or tuple(table.column_names) != COLUMNS:
        raise ScoresError(f"{part_file(scores, record.name, '.parquet')} has {table.num_rows} rows and columns "
                          f"{table.column_names}, not the {record.rows} rows of the score table")
    return table


def read_part_embeddings(scores: str, record: PartRecord) -> tuple[np.ndarray, np.ndarray]:
    """A part's image and text embeddings (float16, ``[rows, width]``; ``[0, 0]`` for a part without rows), their
    bytes checked against the record."""
    width = record.width
    location = part_file(scores, record.name, ".npz")
    data = _checked_bytes(scores, record, ".npz", record.embeddings_sha256)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
            image, text = (arrays[name] for name in EMBEDDINGS)
    except Exception as err:  # numpy's errors for a file that is not an npz of the two arrays
        raise ScoresError(f"{location} is not an npz of {' and '.join(EMBEDDINGS)} embeddings ({err})") from None
    for array in (image, text):
        if array.shape != (record.rows, width):
            raise ScoresError(f"{location} holds embeddings of shape {list(array.shape)}, not [{record.rows}, "
                              f"{width}]")
    return image, text


@dataclass(frozen=True)
class PartRows:
    """A part's rows as a filter that reads embeddings takes them, in the part's order: each row's position in its
    shard (where the sample lay in the tar, as scoring read it: not the row's number, since an unreadable sample
    leaves a gap), its image-text cosine, and its embeddings, ``[rows, width]`` with the pool's width even for a
    part without rows (a shard in which nothing decoded)."""

    name: str
    positions: np.ndarray  # int32
    clip_scores: np.ndarray  # float32
    image: np.ndarray  # float16
    text: np.ndarray


def read_part_rows(scores: str, record: PartRecord, width: int) -> PartRows:
    """Part ``record`` of the scores folder ``scores`` whose embeddings are ``width`` wide, checked as read."""
    table = read_part_table(scores, record)
    if not record.rows:
        empty = np.zeros((0, width), np.float16)
        return PartRows(record.name, np.zeros(0, np.int32), np.zeros(0, np.float32), empty, empty)
    image, text = read_part_embeddings(scores, record)
    if image.shape[1] != width:
        raise ScoresError(f"{part_file(scores, record.name, '.npz')} holds embeddings {image.shape[1]} wide, the "
                          f"pool's are {width}: a part of another model")
    return PartRows(record.name, table.column("position").to_numpy().astype(np.int32),
                    table.column("clip_score").to_numpy(zero_copy_only=False).astype(np.float32), image, text)
