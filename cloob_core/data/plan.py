"""What a (re-)run of the download has left to do: the shards of the first pass not yet complete, or the rows
of a retry round; and the guard that keeps a resume from mixing manifests or settings.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from cloob_core import storage
from cloob_core.config import CloobConfig
from cloob_core.data.manifest import Partition
from cloob_core.data.run_manifest import RunManifest
from cloob_core.data.summary import NOT_RETRIED, latest_failures
from cloob_core.data.writer import SETTINGS_FILE, ShardRecord, shard_name
from cloob_core.errors import StageError
from cloob_core.io import json_bytes

Plan = list[tuple[str, int, Sequence[int]]]  # (shard name, base shard, manifest rows) still to build


# The download settings that decide whether a URL can be fetched at all, and not what a shard holds once fetched.
FETCH_KEYS = ("connect_timeout", "read_timeout", "url_deadline", "retries", "backoff", "max_redirects", "max_bytes",
              "respect_opt_out", "allow_private_network")


def fetch_digest(config: CloobConfig) -> str:
    """A digest of the fetch settings (``FETCH_KEYS``), recorded in each shard's record."""
    settings = {key: getattr(config.download, key) for key in FETCH_KEYS}
    return hashlib.sha256(json_bytes(settings)).hexdigest()[:16]


def plan_round(manifest: RunManifest, output: str, records: list[ShardRecord], owned: range, round_: int,
               shard_size: int, fetch: str | None = None) -> Plan:
    """(name, base shard, rows) for each of the ``owned`` shards still to do in this round; from the manifest's
    index alone. With ``fetch`` (the digest of this run's fetch settings), a shard of the first pass with no
    sample, built under other fetch settings, is done again: they may be what failed every row (a refused private
    address, a timeout)."""
    done = {r.name for r in records if fetch is None or round_ or r.successes or r.fetch == fetch}
    plan: Plan = []
    if round_ == 0:
        for shard in manifest.shards(shard_size):
            if shard.number in owned and shard_name(shard.number) not in done:
                plan.append((shard_name(shard.number), shard.number,
                             range(shard.first_row, shard.first_row + shard.rows)))
        return plan
    failed = latest_failures(output, records)
    for shard in sorted(failed):
        if shard not in owned or shard_name(shard, round_) in done:
            continue
        rows = sorted(entry["row"] for entry in failed[shard].values() if entry["reason"] not in NOT_RETRIED)
        if rows:
            plan.append((shard_name(shard, round_), shard, rows))
    return plan


def retry_plan_name(round_: int, partition: Partition) -> str:
    return f"round-{round_:02d}{partition.suffix}.retry-plan.json"


def retry_round(output: str, partition: Partition, records: list[ShardRecord]) -> int:
    """The retry round to run: an unfinished one (resume) or the next one."""
    pattern = re.compile(r"round-(\d+)" + re.escape(partition.suffix) + r"\.retry-plan\.json")
    rounds = [int(m.group(1)) for name in storage.list_names(output) if (m := pattern.fullmatch(name))]
    if rounds:
        last = max(rounds)
        planned = storage.read_json(storage.join(output, retry_plan_name(last, partition)))
        done = {r.name for r in records}
        if any(name not in done for name in planned["shards"]):
            return last
        return last + 1
    return 1


class SettingsMismatch(StageError, ValueError):
    """The output folder was started with another manifest or other shard-shaping settings."""


def settings_of(manifest: RunManifest, config: CloobConfig) -> dict[str, Any]:
    """What decides the content of the shards: the manifest's parts (rows and digest, in order) and the shaping
    settings. A resume must use exactly these (timeouts may change), or the same parts followed by new ones."""
    return {
        "parts": manifest.part_fingerprints(),
        "expected_shards": manifest.shard_count(config.preprocess.shard_size),
        "dedup_urls": config.download.dedup_urls,
        "preprocess": config.preprocess.model_dump(),
    }


def shards_folder(store: str, source: str, config: CloobConfig) -> str:
    """Where in ``store`` the shards of the manifest acquired from ``source`` are built under ``config``: a folder
    named by a digest of the source and the shaping settings. A later run on the same source resumes or reuses
    it, and when the source has gained parts, builds only their shards; other settings get a folder of their
    own rather than tripping the resume guard."""
    shaping = {"source": source, "dedup_urls": config.download.dedup_urls,
               "preprocess": config.preprocess.model_dump()}
    digest = hashlib.sha256(json_bytes(shaping)).hexdigest()[:16]
    return storage.join(store, f"shards-{digest}")


def manifest_folder(store: str, source: str, split: str) -> str:
    """Where in ``store`` the run manifest of ``source`` lives: a folder named by the source, so that the next
    acquire of a grown source keeps the unchanged parts it wrote before."""
    digest = hashlib.sha256(json_bytes({"source": source, "split": split})).hexdigest()[:16]
    return storage.join(store, f"manifest-{digest}")


def check_settings(output: str, settings: dict[str, Any]) -> None:
    """Record ``settings`` in a new output. In an existing one, accept them when they equal the recorded ones, or
    when they add parts after the recorded parts (an incremental run: the extension is recorded)."""
    location = storage.join(output, SETTINGS_FILE)
    try:
        recorded = storage.read_json(location)
    except FileNotFoundError:
        storage.write_bytes(location, json_bytes(settings))
        return
    old_parts, new_parts = recorded.get("parts", []), settings["parts"]
    flat_new, flat_old = _flatten(_shaping(settings)), _flatten(_shaping(recorded))
    changed = [f"{k}: {flat_old.get(k)!r} before, {flat_new.get(k)!r} now" for k in sorted(flat_new | flat_old)
               if flat_new.get(k) != flat_old.get(k)]
    if new_parts[: len(old_parts)] != old_parts:
        first = next((i for i, (old, new) in enumerate(zip(old_parts, new_parts, strict=False)) if old != new),
                     len(new_parts))
        changed.insert(0, f"manifest: part {first} is {_part(new_parts, first)} now, was {_part(old_parts, first)} "
                          "(only parts added after the others can be built into this folder)")
    if changed:
        raise SettingsMismatch(
            f"{output} was started with another manifest or other settings, and resuming would mix them:\n  "
            + "\n  ".join(changed) + "\nUse a new output folder, or the original manifest and settings."
        )
    if len(new_parts) > len(old_parts):
        storage.write_bytes(location, json_bytes(settings))


def _shaping(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in ("parts", "expected_shards")}


def _part(parts: list[str], index: int) -> str:
    if index >= len(parts):
        return "absent"
    rows, _, digest = parts[index].partition(":")
    return f"{rows} rows (sha256 {digest[:12]})"


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


