"""What a (re-)run of the download has left to do: the shards of the first pass not yet complete, or the rows
of a retry round; and the guard that keeps a resume from mixing manifests or settings.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from cloob_core import storage
from cloob_core.config import CloobConfig
from cloob_core.data.manifest import Manifest, Partition
from cloob_core.data.summary import NOT_RETRIED, latest_failures
from cloob_core.data.writer import SETTINGS_FILE, ShardRecord, shard_name
from cloob_core.errors import StageError
from cloob_core.io import json_bytes


def plan_round(manifest: Manifest, output: str, records: list[ShardRecord], partition: Partition,
               round_: int, shard_size: int) -> list[tuple[str, int, list[int]]]:
    """(name, base shard, rows) for each shard still to do in this round."""
    done = {r.name for r in records}
    plan = []
    if round_ == 0:
        for shard in range(manifest.shard_count(shard_size)):
            if partition.owns(shard) and shard_name(shard) not in done:
                start = shard * shard_size
                plan.append((shard_name(shard), shard, list(range(start, min(start + shard_size, len(manifest))))))
        return plan
    failed = latest_failures(output, records)
    for shard in sorted(failed):
        if not partition.owns(shard) or shard_name(shard, round_) in done:
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


def settings_of(manifest: Manifest, config: CloobConfig) -> dict[str, Any]:
    """What decides the content of the shards; a resume must use exactly these (timeouts may change)."""
    return {
        "manifest_rows": len(manifest),
        "manifest_sha256": manifest.fingerprint(),
        "dedup_urls": config.download.dedup_urls,
        "preprocess": config.preprocess.model_dump(),
    }


def shards_folder(store: str, manifest: Manifest, config: CloobConfig) -> str:
    """Where in ``store`` the shards of ``manifest`` are built under ``config``: a folder named by a digest of
    :func:`settings_of`, so a later run on the same rows with the same settings resumes or reuses it, and any
    change gets a folder of its own rather than tripping the resume guard."""
    digest = hashlib.sha256(json_bytes(settings_of(manifest, config))).hexdigest()[:16]
    return storage.join(store, f"shards-{digest}")


def check_settings(output: str, settings: dict[str, Any]) -> None:
    location = storage.join(output, SETTINGS_FILE)
    try:
        recorded = storage.read_json(location)
    except FileNotFoundError:
        storage.write_bytes(location, json_bytes(settings))
        return
    flat_new, flat_old = _flatten(settings), _flatten(recorded)
    changed = [f"{k}: {flat_old.get(k)!r} before, {flat_new.get(k)!r} now" for k in sorted(flat_new | flat_old)
               if flat_new.get(k) != flat_old.get(k)]
    if changed:
        raise SettingsMismatch(
            f"{output} was started with another manifest or other settings, and resuming would mix them:\n  "
            + "\n  ".join(changed) + "\nUse a new output folder, or the original manifest and settings."
        )


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


