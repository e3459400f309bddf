"""The kept samples of a scored pool written out as shards in the usual layout (``NNNNN.tar`` with their
``_stats.json`` and ``_failures.jsonl``; ``sizes.json``, ``stats.json`` and ``failures.jsonl``), which `cloob
train`, the shard gate and open_clip read as they are. A sample's members are copied as they are (no decode, no
re-encode); its json gains ``curation``: its scores and where it came from.

The kept rows stream from the engine in pool order (shard, then position) a batch at a time, and each source tar is
read front to back once, so memory holds one batch of rows and one output shard's record, not the pool.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core.curation.pool import SCORES_VIEW, ScoredPool, scored_samples
from cloob_core.curation.selection import REMOVED_TABLE
from cloob_core.data.summary import OutputSummary, summarize
from cloob_core.data.writer import FAILURES_SUFFIX, STATS_SUFFIX, ShardRecord, ShardWriter, shard_name
from cloob_core.errors import StageError
from cloob_core.io import atomic_write, naming_full_disk, write_json

_BATCH = 65_536  # kept rows fetched from the engine at a time
_CARRIED = ("clip_score", "language", "language_confidence", "phash", "shard", "position")


def _kept_rows(pool: ScoredPool) -> Iterator[dict[str, Any]]:
    """The kept samples' rows, in pool order, a batch at a time."""
    result = pool.connection.execute(
        f"""SELECT s.* FROM {SCORES_VIEW} s ANTI JOIN {REMOVED_TABLE} r USING (shard, position)
            ORDER BY s.shard, s.position""")
    while batch := result.fetchmany(_BATCH):
        names = [column[0] for column in result.description]
        yield from (dict(zip(names, row, strict=True)) for row in batch)


def _by_source(rows: Iterator[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The kept rows grouped by their source shard, in order."""
    current: str | None = None
    group: list[dict[str, Any]] = []
    for row in rows:
        if row["shard"] != current:
            if current is not None:
                yield current, group
            current, group = row["shard"], []
        group.append(row)
    if current is not None:
        yield current, group


@dataclass(frozen=True)
class _Kept:
    """A kept sample as written, with what its shard's record keeps of it."""

    record: dict[str, Any]
    original_sha256: str
    sides: tuple[int, int]


def _kept_samples(pool: ScoredPool) -> Iterator[_Kept]:
    """The kept samples in pool order, each source tar read once, front to back, each sample the one scored at
    its row's position (:func:`scored_samples`)."""
    for source, rows in _by_source(_kept_rows(pool)):
        for row, raw in scored_samples(pool, source, rows):
            members = {suffix: data for suffix, data in raw.items() if not suffix.startswith("__")}
            meta = json.loads(members["json"]) if members.get("json") else {}
            yield _Kept(_sample(row["key"], members, meta, row), str(meta.get("sha256") or row["sha256"]),
                        (row["width"], row["height"]))


class ReshardMismatch(StageError):
    """The resharded samples are not the selection's: a defect, never written as a curated pool."""

    exit_code = 1


def reshard(pool: ScoredPool, folder: Path, shard_size: int, expected: int) -> OutputSummary:
    """The ``expected`` samples the selection keeps into shards of ``shard_size`` in the local folder ``folder`` (a
    staging folder), with the summary files; returns the summary. Fewer or more samples written than kept is
    :class:`ReshardMismatch`."""
    samples = _kept_samples(pool)
    number = 0
    while (first := next(samples, None)) is not None:
        name = shard_name(number)
        tar = folder / f"{name}.tar"
        entries, sides = [], []
        with naming_full_disk(tar), open(tar, "wb") as handle, ShardWriter(handle) as writer:
            for kept in itertools.chain([first], itertools.islice(samples, shard_size - 1)):
                writer.write_sample(kept.record)
                entries.append([kept.record["__key__"], kept.original_sha256])
                sides += kept.sides
        record = ShardRecord(name=name, shard=number, round=0, rows=len(entries), successes=len(entries),
                             failures_by_reason={}, tar=tar.name, samples=entries,
                             image_sides={"min": min(sides), "max": max(sides)}, tar_bytes=tar.stat().st_size)
        write_json(folder / f"{name}{STATS_SUFFIX}", record.to_json())
        atomic_write(folder / f"{name}{FAILURES_SUFFIX}", lambda tmp: tmp.write_bytes(b""))
        number += 1
    summary = summarize(str(folder))
    written = sum(summary.sizes.values())
    if written != expected:
        raise ReshardMismatch(f"resharding wrote {written:,} samples where the curation keeps {expected:,}: nothing is "
                              "published (an internal error; report it)")
    write_json(folder / "sizes.json", summary.sizes)
    write_json(folder / "stats.json", summary.stats)
    atomic_write(folder / "failures.jsonl", lambda tmp: tmp.write_bytes(b""))
    return summary


def _sample(key: str, members: dict[str, bytes | None], meta: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The sample as written: its members as they were, its json with ``curation`` added."""
    meta = {**meta}
    meta["curation"] = {name: (f"{row[name]:016x}" if name == "phash" else row[name]) for name in _CARRIED}
    record: dict[str, Any] = {"__key__": key}
    record |= {suffix: data for suffix, data in members.items() if data is not None and suffix != "json"}
    record["json"] = json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return record

