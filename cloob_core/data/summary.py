"""Whole-output views built from the per-shard records: ``sizes.json`` (open_clip's format), ``stats.json`` and
``failures.jsonl``. Recomputed from scratch each time, so partitions that ran in separate pods merge by simply
running it once over their common output folder (``cloob data merge-stats``).

A row retried in a later round counts by its latest attempt: a retry that succeeds removes it from
``failures.jsonl``.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cloob_core import lease, storage
from cloob_core.data.writer import SETTINGS_FILE, ShardRecord, jsonl_bytes, read_failures, read_records
from cloob_core.io import json_bytes

# Rows dropped as duplicates are not failures to retry: retrying them would duplicate samples.
NOT_RETRIED = frozenset({"duplicate_url", "duplicate_content"})


# A shards folder's whole-output files (open_clip's sizes.json, our stats and failures), rebuilt from the shards'
# own records by merge_stats.
SUMMARY_FILES = ("sizes.json", "stats.json", "failures.jsonl")


@dataclass
class OutputSummary:
    sizes: dict[str, int]
    stats: dict[str, Any]
    failures: list[dict[str, Any]]


def latest_failures(folder: str, records: list[ShardRecord]) -> dict[int, dict[str, dict[str, Any]]]:
    """Per base shard: key → failure entry of the row's latest attempt (rows that later succeeded are gone)."""
    by_shard: dict[int, dict[str, dict[str, Any]]] = {}
    with ThreadPoolExecutor(16) as pool:  # on S3 each file is a GET
        failure_lists = pool.map(lambda record: read_failures(folder, record.name), records)
        for record, entries in zip(records, failure_lists, strict=True):  # by shard, then round
            failed = by_shard.setdefault(record.shard, {})
            for key, _sha in record.samples:
                failed.pop(key, None)
            for entry in entries:
                failed[entry["key"]] = entry
    return by_shard


def summarize(folder: str, records: list[ShardRecord] | None = None) -> OutputSummary:
    records = read_records(folder) if records is None else records
    failures_by_shard = latest_failures(folder, records)
    failures = [entry for shard in sorted(failures_by_shard) for _, entry in sorted(failures_by_shard[shard].items())]
    reasons = Counter(entry["reason"] for entry in failures)
    base_rows = sum(r.rows for r in records if r.round == 0)
    successes = sum(r.successes for r in records)
    sizes = {r.tar: r.successes for r in records if r.tar}
    sides = [r.image_sides for r in records if r.image_sides]
    dropped = {reason: reasons.get(reason, 0) for reason in sorted(NOT_RETRIED)}
    expected = _expected_shards(folder)
    present = len({r.shard for r in records if r.round == 0})
    stats = {
        "rows": base_rows,
        "expected_shards": expected,
        "missing_shards": None if expected is None else expected - present,
        "successes": successes,
        "failures": len(failures),
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
    return OutputSummary(dict(sorted(sizes.items())), stats, failures)


def _expected_shards(folder: str) -> int | None:
    """First-pass shard count of the whole manifest, from the settings the download recorded (None if absent)."""
    try:
        settings = storage.read_json(storage.join(folder, SETTINGS_FILE))
    except FileNotFoundError:
        return None
    return settings.get("expected_shards")


def write_summary(folder: str, summary: OutputSummary) -> None:
    sizes, stats, failures = SUMMARY_FILES
    storage.write_bytes(storage.join(folder, sizes), json_bytes(summary.sizes))
    storage.write_bytes(storage.join(folder, stats), json_bytes(summary.stats))
    storage.write_bytes(storage.join(folder, failures), jsonl_bytes(summary.failures))


@lease.holding("folder", "merge")
def merge_stats(folder: str) -> OutputSummary:
    """Recompute and write the whole-output files of ``folder`` from its per-shard records."""
    summary = summarize(folder)
    write_summary(folder, summary)
    return summary


def format_summary(summary: OutputSummary) -> str:
    stats = summary.stats
    missing = stats.get("missing_shards")
    lines = [] if not missing else [
        f"INCOMPLETE: {missing} of {stats['expected_shards']} shards are missing (partitions still running, or "
        "an interrupted run to re-run)"
    ]
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


