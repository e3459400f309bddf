"""Finding and opening a folder of shards, for its readers (the training streams, the evaluation's shard sets):
the shard list and sample count from ``sizes.json`` (or a brace pattern, or the folder's tars), ``s3://`` for
webdataset through fsspec (s3fs), and the handler that skips what cannot be read with a count instead of ending a run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from cloob_core import publish, storage
from cloob_core.io import UnreadableFile, parse_json

log = logging.getLogger(__name__)
_BRACES = re.compile(r"\{\d+\.\.\d+\}")
CURATION_REPORT = "curation_report.json"  # beside curated shards (`cloob data curate`): what the gate judges
# the report's reasons of a cut by score, which is only as good as the scorer's separation (the gate checks it)
SCORE_CUTS = ("min_clip_score", "top_fraction")


def score_cut_settings(removed_by: dict[str, int]) -> str | None:
    """The settings of the cuts by score a curation report's ``removed_by`` holds, as a message names them
    ("curation.top_fraction"); None where it holds none."""
    cuts = [f"curation.{reason}" for reason in SCORE_CUTS if reason in removed_by]
    return " and ".join(cuts) or None


# a sample's image members that training, evaluation, scoring and the shard gate read, in this order: `cloob data`
# writes jpg; a crawl's own shards, and the curated shards resharded from them, may hold the others
IMAGE_KEYS = ("jpg", "jpeg", "png", "webp")


def _gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192, **_: Any) -> Any:
    if mode not in ("rb", "r"):
        raise ValueError(f"{url}: s3 shards open for reading only")
    return storage.open_read(url)


def register_s3() -> None:
    """Let webdataset open ``s3://`` shards through s3fs (its own handler pipes through the AWS CLI)."""
    sys.modules["webdataset.gopen"].gopen_schemes["s3"] = _gopen_s3  # the package re-exports a function of that name


@dataclass
class SkipCounter:
    """A webdataset handler that skips what cannot be read, counting and logging it (first few in full)."""

    log_first: int = 5
    skipped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, exn: Exception, samples: int = 1) -> bool:
        """Skip what ``exn`` says did not read: ``samples`` samples (a broken tar's, where they are known)."""
        with self._lock:
            before = self.skipped
            self.skipped += samples
            name = type(exn).__name__
            self.reasons[name] = self.reasons.get(name, 0) + samples
            if before < self.log_first:
                log.warning("skipping unreadable data (%s: %s)", name, str(exn)[:300])
            elif any(before < mark <= self.skipped for mark in (self.log_first + 1, 100, 1000, 10000)):
                log.warning("skipped %d unreadable samples or shards so far", self.skipped)
        return True


def shard_list(location: str | list[str]) -> tuple[list[str], int | None]:
    """Shard URLs and the sample count: a folder with ``sizes.json``, a brace pattern, or a list of URLs."""
    if isinstance(location, list):
        return location, None
    if _BRACES.search(location) or location.endswith(".tar"):
        import braceexpand

        return list(braceexpand.braceexpand(location)), None
    sizes = shard_sizes(location)
    if sizes is None:
        names = storage.list_names(location, ".tar")
        if not names:
            raise FileNotFoundError(f"no sizes.json and no .tar shards in {location}") from None
        return [storage.join(location, name) for name in names], None
    return list(sizes), int(sum(sizes.values()))


def shard_sizes(location: str) -> dict[str, int] | None:
    """Each shard's URL and sample count, in order, from the folder's ``sizes.json`` (None: it has none)."""
    sizes_file = storage.join(location, "sizes.json")
    try:
        raw = summary_file(location, "sizes.json")
    except FileNotFoundError:
        return None
    sizes = parse_json(raw, sizes_file)
    if not isinstance(sizes, dict) or not sizes or not all(
            isinstance(n, str) and isinstance(c, int) and c >= 0 for n, c in sizes.items()):
        raise UnreadableFile(f"{sizes_file} must map shard names to sample counts, got {str(sizes)[:80]}")
    return {storage.join(location, name): sizes[name] for name in sorted(sizes)}


def summary_file(folder: str, name: str) -> bytes:
    """One of a shard folder's whole-output files (``sizes.json``, ``stats.json``, ``failures.jsonl``), through
    the unit ``cloob data merge-stats`` published where there is one (a merge stopped part-way is completed or
    refused, never read half old, half new); FileNotFoundError if absent."""
    unit = publish.unit_of(folder)
    if unit is not None and name in unit.files:
        return unit.read(name)
    return storage.read_bytes(storage.join(folder, name))


def _stats(location: str) -> dict[str, Any]:
    try:
        stats = parse_json(summary_file(location, "stats.json"), storage.join(location, "stats.json"))
    except FileNotFoundError:
        return {}
    return stats if isinstance(stats, dict) else {}


def missing_shards(location: str | list[str]) -> str | None:
    """Why the shard folder ``location`` is incomplete (its stats.json counts missing shards: partitions still
    downloading, or a run to resume), or None."""
    if isinstance(location, list) or _BRACES.search(location) or location.endswith(".tar"):
        return None
    stats = _stats(location)
    missing = stats.get("missing_shards")
    if isinstance(missing, int) and missing > 0:
        return f"{missing} of {stats.get('expected_shards')} shards are missing"
    return None


def shard_listings(urls: list[str]) -> dict[str, dict[str, tuple[int, str]]]:
    """Each folder of ``urls`` (``"."`` for a bare name) -> its files' ``name -> (size, version)``, from one
    listing per folder rather than a request per shard (the version: an S3 ETag, or the local size and time). A
    folder storage cannot list (``http://``, ``pipe:``) has no entries."""
    folders: dict[str, dict[str, tuple[int, str]]] = {}
    for url in urls:
        folder = url.rpartition("/")[0] or "."
        if folder in folders:
            continue
        try:
            listed = storage.tree_entries(folder)
        except Exception:  # a folder storage cannot list: its shards are known by name only
            listed = []
        folders[folder] = {path: (size, version) for path, size, version in listed if "/" not in path}
    return folders


def shard_entry(listings: dict[str, dict[str, tuple[int, str]]], url: str) -> tuple[int, str] | None:
    """The shard ``url``'s ``(size, version)`` in :func:`shard_listings`' result; None where it was not listed."""
    folder, _, name = url.rpartition("/")
    return listings.get(folder or ".", {}).get(name)


def shards_fingerprint(urls: list[str]) -> str:
    """What tells one training data set from another, cheaply: each shard's name and byte size, from one listing
    per folder. Shards rebuilt with other settings (size, resizing, captions) differ in size; the location does not
    count, so the same shards moved to S3 keep their fingerprint. (A content digest would read every shard.)"""
    listings = shard_listings(urls)
    listed = [(url.rpartition("/")[2], None if (entry := shard_entry(listings, url)) is None else entry[0])
              for url in urls]
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16]
