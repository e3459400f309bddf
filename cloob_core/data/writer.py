"""The writer: the shard layout every later stage reads, and the per-shard records that make runs resumable.

Per shard ``NAME`` the output folder holds ``NAME.tar`` (per sample ``KEY.jpg``, ``KEY.txt``, ``KEY.json``),
``NAME_failures.jsonl`` (one line per row that did not make it, with the reason) and ``NAME_stats.json``.
The stats file is written last and marks the shard complete. Tars are byte-reproducible: fixed member order,
owner and mtime, so an interrupted and resumed run yields the very bytes of an uninterrupted one.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cloob_core import storage
from cloob_core.io import naming_full_disk, parse_json

STATS_SUFFIX = "_stats.json"
FAILURES_SUFFIX = "_failures.jsonl"
SETTINGS_FILE = "download_settings.json"  # what shaped the shards; checked on resume, read by merge-stats
_NAME = re.compile(r"^(?P<base>\d{5,})(?:-retry(?P<round>\d{2,}))?$")


def shard_name(shard: int, round_: int = 0) -> str:
    return f"{shard:05d}" if round_ == 0 else f"{shard:05d}-retry{round_:02d}"


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """``00012-retry01`` → (12, 1); None for names that are not ours."""
    match = _NAME.match(name)
    if not match:
        return None
    return int(match.group("base")), int(match.group("round") or 0)


def sample_record(key: str, jpeg: bytes, caption: str, meta: dict[str, Any]) -> dict[str, Any]:
    return {
        "__key__": key,
        "jpg": jpeg,
        "txt": caption.encode("utf-8"),
        "json": json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8"),
    }


_BLOCK = tarfile.BLOCKSIZE
_RECORD = tarfile.RECORDSIZE  # a tar stream ends padded to whole records of 20 blocks, as tar -b20 writes
_NAME_FIELD = 100
# A member header as tarfile writes ours (USTAR; mode 0444, owner and group "cloob", ids and mtime 0): the name,
# the size and the checksum are filled in. Built directly, a header costs 2 µs instead of tarfile's 25 µs.
_HEAD_MODE_IDS = b"0000444\0" + b"0000000\0" * 2
_HEAD_AFTER_SIZE = b"00000000000\0"  # mtime 0
_HEAD_TAIL = (b"0" + tarfile.NUL * 100 + tarfile.POSIX_MAGIC + b"cloob".ljust(32, tarfile.NUL) * 2
              + tarfile.NUL * (16 + 155)).ljust(_BLOCK - 156, tarfile.NUL)  # no device numbers, no prefix


def member_header(name: str, size: int) -> bytes:
    """The header block tarfile writes for a member of ours named ``name`` of ``size`` bytes (what ``tarfile``
    gives, byte for byte, and what it is used for where a name needs USTAR's prefix field)."""
    encoded = name.encode("utf-8", "surrogateescape")
    if len(encoded) > _NAME_FIELD or size >= 8**11:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, 0, 0o444
        info.uname = info.gname = "cloob"
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    head = encoded.ljust(_NAME_FIELD, tarfile.NUL) + _HEAD_MODE_IDS + b"%011o\0" % size + _HEAD_AFTER_SIZE
    checksum = sum(head) + 8 * 0x20 + sum(_HEAD_TAIL)  # the checksum field counts as eight spaces
    return head + b"%06o\0 " % checksum + _HEAD_TAIL


class ShardWriter:
    """A reproducible WebDataset tar, streamed: members in key order, fixed owner, mode and mtime.

    The bytes are those of ``tarfile.open(mode="w|", format=USTAR_FORMAT)`` (a test holds them to it). Written
    without ``webdataset.TarWriter``, whose import imports torch (seconds and hundreds of MB in every download
    worker), and without ``tarfile``'s writer, whose per-member Python costs as much as a small image's resize.
    """

    def __init__(self, stream: IO[bytes]):
        self._stream = stream
        self._offset = 0
        self._closed = False
        self.count = 0

    def write(self, key: str, jpeg: bytes, caption: str, meta: dict[str, Any]) -> None:
        self.write_sample(sample_record(key, jpeg, caption, meta))

    def copy_member(self, member: tarfile.TarInfo, data: IO[bytes] | None) -> None:
        """A member of a tar we wrote (its owner, mode and mtime are ours)."""
        self._write(self._member(member.name, data.read() if data is not None else b""))

    def write_sample(self, record: dict[str, Any]) -> None:
        """``{"__key__": key, suffix: bytes, …}``, members in suffix order."""
        key = record["__key__"]
        self._write(b"".join(self._member(f"{key}.{suffix}", record[suffix])
                             for suffix in sorted(k for k in record if k != "__key__")))
        self.count += 1

    @staticmethod
    def _member(name: str, data: bytes) -> bytes:
        return member_header(name, len(data)) + data + tarfile.NUL * (-len(data) % _BLOCK)

    def _write(self, data: bytes) -> None:
        self._stream.write(data)
        self._offset += len(data)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, failed: type[BaseException] | None, *_: object) -> None:
        """The tar's closing blocks after a complete write; after a failed one, nothing (:meth:`abandon`)."""
        if failed is None:
            self.close()
        else:
            self.abandon()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            end = self._offset + 2 * _BLOCK
            self._stream.write(tarfile.NUL * (2 * _BLOCK + -end % _RECORD))

    def abandon(self) -> None:
        """Give up a tar whose stream failed (a full disk): no closing blocks are written."""
        self._closed = True


def copy_without(source: Path, target: Path, drop_keys: set[str]) -> int:
    """Rewrite a tar we wrote ourselves, leaving out the samples in ``drop_keys``; returns samples kept."""
    kept = set()
    with (naming_full_disk(target), tarfile.open(source, "r|") as reader, open(target, "wb") as out,
          ShardWriter(out) as writer):
        for member in reader:
            key = member.name.split(".", 1)[0]
            if key in drop_keys:
                continue
            kept.add(key)
            writer.copy_member(member, reader.extractfile(member))
    return len(kept)


@dataclass
class ShardRecord:
    """One shard's ``_stats.json``: what was attempted and what came of it."""

    name: str
    shard: int
    round: int
    rows: int
    successes: int
    failures_by_reason: dict[str, int]
    tar: str | None
    samples: list[list[str]] = field(default_factory=list)  # [key, sha256 of the original bytes]
    image_sides: dict[str, int] = field(default_factory=dict)  # min/max of stored width and height
    tar_bytes: int = 0
    fetch: str = ""  # the digest of the fetch settings it was built with (plan.fetch_digest)

    @property
    def failures(self) -> int:
        return sum(self.failures_by_reason.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "shard": self.shard, "round": self.round, "rows": self.rows,
            "successes": self.successes, "failures": self.failures, "failures_by_reason": self.failures_by_reason,
            "tar": self.tar, "tar_bytes": self.tar_bytes,
            "image_sides": self.image_sides, "samples": self.samples, "fetch": self.fetch,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShardRecord:
        return cls(name=data["name"], shard=data["shard"], round=data["round"], rows=data["rows"],
                   successes=data["successes"], failures_by_reason=dict(data["failures_by_reason"]),
                   tar=data["tar"], samples=data.get("samples", []),
                   image_sides=data.get("image_sides", {}), tar_bytes=data.get("tar_bytes", 0),
                   fetch=data.get("fetch", ""))


def read_records(folder: str, owned: Callable[[int], bool] | None = None) -> list[ShardRecord]:
    """Every completed shard's record in ``folder`` (with ``owned``, those of the shards it accepts: a partition
    reads its own), by shard then round (read in parallel: on S3 each is a GET)."""
    names = [n for n in storage.list_names(folder, STATS_SUFFIX)
             if (parsed := parse_shard_name(n[: -len(STATS_SUFFIX)])) and (owned is None or owned(parsed[0]))]

    def read(name: str) -> ShardRecord:
        return ShardRecord.from_json(storage.read_json(storage.join(folder, name)))

    with ThreadPoolExecutor(16) as pool:
        records = list(pool.map(read, names))
    return sorted(records, key=lambda r: (r.shard, r.round))


def read_failures(folder: str, name: str) -> list[dict[str, Any]]:
    try:
        location = storage.join(folder, name + FAILURES_SUFFIX)
        lines = storage.read_bytes(location).splitlines()
    except FileNotFoundError:
        return []
    return [parse_json(line, location) for line in lines if line.strip()]


def jsonl_bytes(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")


def tar_samples(location: str, read: Callable[[str], bool]) -> Iterator[tuple[str, dict[str, bytes | None]]]:
    """(key, member suffix -> bytes) for each sample of a tar, streamed; the bytes only of samples whose key
    ``read`` picks (None otherwise). Tolerant of nothing but our own layout."""
    with storage.open_read(location) as stream, tarfile.open(fileobj=stream, mode="r|") as reader:
        current, members = None, {}
        for member in reader:
            key, _, suffix = member.name.partition(".")
            if key != current:
                if current is not None:
                    yield current, members
                current, members, wanted = key, {}, read(key)
            handle = reader.extractfile(member) if wanted and member.isfile() else None
            members[suffix] = handle.read() if handle is not None else None
        if current is not None:
            yield current, members

