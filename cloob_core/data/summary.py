"""Whole-output views built from the per-shard records: ``sizes.json`` (open_clip's format), ``stats.json`` and
``failures.jsonl``. Recomputed from scratch each time, so partitions that ran in separate pods merge by simply
running it once over their common output folder (``cloob data merge-stats``). The failures are streamed shard by
shard into the file and counted on the way: a 10^9-row crawl has hundreds of millions of them.

A row retried in a later round counts by its latest attempt: a retry that succeeds removes it from
``failures.jsonl``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any

from cloob_core import lease, publish, storage
from cloob_core.config import CPU_DATA_STREAMS
from cloob_core.data.writer import SETTINGS_FILE, ShardRecord, jsonl_bytes, read_failures, read_records
from cloob_core.io import json_bytes

# Rows dropped as duplicates are not failures to retry: retrying them would duplicate samples.
NOT_RETRIED = frozenset({"duplicate_url", "duplicate_content"})


# A shards folder's whole-output files (open_clip's sizes.json, our stats and failures), rebuilt from the shards'
# own records by merge_stats.
SUMMARY_FILES = ("sizes.json", "stats.json", "failures.jsonl")
MERGE_LEASE = "merge"


FIRST_FAILURES = 20


@dataclass
class OutputSummary:
    sizes: dict[str, int]
    stats: dict[str, Any]
    first_failures: list[dict[str, Any]] = field(default_factory=list)  # the first few, in shard order


def latest_failures(folder: str, records: list[ShardRecord]) -> dict[int, dict[str, dict[str, Any]]]:
    """Per base shard: key → failure entry of the row's latest attempt (rows that later succeeded are gone)."""
    return dict(_latest_failures_by_shard(folder, records))


def _latest_failures_by_shard(folder: str, records: list[ShardRecord],
                              ahead: int = 64) -> Iterator[tuple[int, dict[str, dict[str, Any]]]]:
    """(base shard, its rows' latest failures) in shard order, reading ``ahead`` shards' files at a time (on S3
    each is a GET), so memory holds a few shards' failures, not the output's."""
    groups = ((shard, list(rounds)) for shard, rounds in itertools.groupby(records, key=lambda r: r.shard))
    with ThreadPoolExecutor(16) as pool:
        while batch := list(itertools.islice(groups, ahead)):
            read = pool.map(lambda group: [read_failures(folder, r.name) for r in group[1]], batch)
            for (shard, rounds), entries_by_round in zip(batch, read, strict=True):
                failed: dict[str, dict[str, Any]] = {}
                for record, entries in zip(rounds, entries_by_round, strict=True):  # by round
                    for key, _sha in record.samples:
                        failed.pop(key, None)
                    for entry in entries:
                        failed[entry["key"]] = entry
                yield shard, failed


def summarize(folder: str, records: list[ShardRecord] | None = None,
              failures_out: IO[bytes] | None = None) -> OutputSummary:
    """The output's sizes and stats from ``records`` (default: every record of ``folder``); each failure is
    written to ``failures_out`` as it is read (a JSON line, in shard and key order), never all held."""
    records = read_records(folder) if records is None else records
    reasons: Counter[str] = Counter()
    first: list[dict[str, Any]] = []
    for _, failed in _latest_failures_by_shard(folder, records):
        for _, entry in sorted(failed.items()):
            reasons[entry["reason"]] += 1
            if len(first) < FIRST_FAILURES:
                first.append(entry)
            if failures_out is not None:
                failures_out.write(jsonl_bytes([entry]))
    base_rows = sum(r.rows for r in records if r.round == 0)
    successes = sum(r.successes for r in records)
    sizes = {r.tar: r.successes for r in records if r.tar}
    sides = [r.image_sides for r in records if r.image_sides]
    dropped = {reason: reasons.get(reason, 0) for reason in sorted(NOT_RETRIED)}
    expected = _expected_shards(folder)
    present = len({r.shard for r in records if r.round == 0})
    failures = sum(reasons.values())
    stats = {
        "rows": base_rows,
        "expected_shards": expected,
        "missing_shards": None if expected is None else expected - present,
        "successes": successes,
        "failures": failures,
        "success_ratio": successes / base_rows if base_rows else 0.0,
        "failures_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "duplicates_dropped": dropped,
        "shards": len(sizes),
        "shard_records": len(records),
        "retry_rounds": max((r.round for r in records), default=0),
        "bytes": sum(r.tar_bytes for r in records),
        "image_side_min": min((s["min"] for s in sides), default=None),
        "image_side_max": max((s["max"] for s in sides), default=None),
    }
    return OutputSummary(dict(sorted(sizes.items())), stats, first)


def _expected_shards(folder: str) -> int | None:
    """First-pass shard count of the whole manifest, from the settings the download recorded (None if absent)."""
    try:
        settings = storage.read_json(storage.join(folder, SETTINGS_FILE))
    except FileNotFoundError:
        return None
    return settings.get("expected_shards")


@lease.holding("folder", MERGE_LEASE)
def merge_stats(folder: str) -> OutputSummary:
    """Recompute the whole-output files of ``folder`` from its per-shard records and publish them as one unit
    (:mod:`cloob_core.publish`): a run stopped part-way leaves the previous three, a finished one the new three.
    ``failures.jsonl`` is streamed to a local file, never held."""
    sizes_name, stats_name, failures_name = SUMMARY_FILES
    with publish.staged(folder, lease_name=MERGE_LEASE) as staging:
        with open(staging / failures_name, "wb") as failures_out:
            summary = summarize(folder, failures_out=failures_out)
        (staging / sizes_name).write_bytes(json_bytes(summary.sizes))
        (staging / stats_name).write_bytes(json_bytes(summary.stats))
    return summary


def too_few_shards(stats: dict[str, Any]) -> str | None:
    """Why these shards cannot feed training's default data streams (one shard per stream; 8 on the CPU), with
    the shard size that would: a small set in the default shards of 256 is one or two shards."""
    shards, samples = stats.get("shards") or 0, stats.get("successes") or 0
    if not 0 < shards < CPU_DATA_STREAMS:
        return None
    size = max(1, samples // CPU_DATA_STREAMS)
    return (f"{shards} shard(s) feed at most {shards} training data stream(s), and training reads "
            f"{CPU_DATA_STREAMS} on the CPU (one per core and GPU on GPUs), each shard by one of them: write them "
            f"again with preprocess.shard_size at most {size} (--shard-size {size}) for {CPU_DATA_STREAMS} shards")


def format_summary(summary: OutputSummary) -> str:
    stats = summary.stats
    missing = stats.get("missing_shards")
    lines = [] if not missing else [
        f"INCOMPLETE: {missing} of {stats['expected_shards']} shards are missing (partitions still running, or "
        "an interrupted run to re-run)"
    ]
    few = too_few_shards(stats) if not missing else None
    if few:
        lines.append(f"warning: {few}")
    lines += [
        f"rows {stats['rows']}, samples written {stats['successes']} "
        f"({100 * stats['success_ratio']:.1f}%), failed or dropped {stats['failures']}, "
        f"shards {stats['shards']}",
    ]
    if stats["failures_by_reason"]:
        width = max(len(reason) for reason in stats["failures_by_reason"])
        lines.append(f"  {'reason':<{width}}  {'rows':>8}  share")
        for reason, count in stats["failures_by_reason"].items():
            share = count / stats["rows"] if stats["rows"] else 0.0
            lines.append(f"  {reason:<{width}}  {count:>8}  {100 * share:5.1f}%")
    return "\n".join(lines)


