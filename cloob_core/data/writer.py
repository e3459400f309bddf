"""The writer: the shard layout every later stage reads, and the per-shard records that make runs resumable.

Per shard ``NAME`` the output folder holds ``NAME.tar`` (per sample ``KEY.jpg``, ``KEY.txt``, ``KEY.json``),
``NAME_failures.jsonl`` (one line per row that did not make it, with the reason) and ``NAME_stats.json``.
The stats file is written last and marks the shard complete. Tars are byte-reproducible: fixed member order,
owner and mtime, so an interrupted and resumed run yields the very bytes of an uninterrupted one.
"""

from __future__ import annotations

import io
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


class ShardWriter:
    """A reproducible WebDataset tar: members in key order, fixed owner, mode and mtime.

    Written with the standard library rather than ``webdataset.TarWriter``: importing webdataset imports
    torch, which would add seconds and hundreds of MB to every download worker process.
    """

    def __init__(self, stream: IO[bytes]):
        self._tar = tarfile.open(fileobj=stream, mode="w|", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
        self.count = 0

    def write(self, key: str, jpeg: bytes, caption: str, meta: dict[str, Any]) -> None:
        self.write_sample(sample_record(key, jpeg, caption, meta))

    def copy_member(self, member: tarfile.TarInfo, data: IO[bytes] | None) -> None:
        self._tar.addfile(member, data)

    def write_sample(self, record: dict[str, Any]) -> None:
        """``{"__key__": key, suffix: bytes, …}``, members in suffix order."""
        key = record["__key__"]
        for suffix in sorted(k for k in record if k != "__key__"):
            data = record[suffix]
            info = tarfile.TarInfo(f"{key}.{suffix}")
            info.size, info.mtime, info.mode = len(data), 0, 0o444
            info.uname = info.gname = "cloob"
            self._tar.addfile(info, io.BytesIO(data))
        self.count += 1

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, failed: type[BaseException] | None, *_: object) -> None:
        """The tar's closing blocks after a complete write; after a failed one, nothing (:meth:`abandon`)."""
        if failed is None:
            self._tar.close()
        else:
            self.abandon()

    def abandon(self) -> None:
        """Give up a tar whose stream failed (a full disk): no closing blocks are written, and the stream does not
        try again when it is collected (tarfile's ``_Stream.__del__`` would, into a closed file)."""
        self._tar.closed = True
        self._tar.fileobj.closed = True


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

