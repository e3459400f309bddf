"""The worker side of the download engine: one process builds one shard at a time, its rows fetched and
processed by a pool of threads (downloader → resizer) and written, in row order, to a staging tar.

Workers are spawned and import neither torch nor pandas; a row that fails in an unexpected way is recorded as a
failure of that row, never of its shard.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cloob_core.config import PreprocessConfig
from cloob_core.data.imaging import caption_refusal, process_image
from cloob_core.data.manifest import ManifestRow
from cloob_core.data.sources import Source
from cloob_core.data.writer import ShardWriter
from cloob_core.io import naming_full_disk
from cloob_core.redact import Redactor

log = logging.getLogger(__name__)

_RESERVED_META = ("key", "url", "caption", "status", "row", "sha256", "original_width", "original_height",
                  "width", "height")


@dataclass(frozen=True)
class ShardJob:
    name: str
    shard: int
    round: int
    rows: list[ManifestRow]
    duplicate_of: dict[int, str]  # row → key of the first row with the same URL
    staging: str


@dataclass
class RowOutcome:
    row: int
    key: str
    url: str  # as recorded: redacted (cloob_core.redact)
    reason: str | None = None
    detail: str = ""
    sha256: str | None = None
    width: int = 0
    height: int = 0

    def failure(self) -> dict[str, Any]:
        return {"row": self.row, "key": self.key, "url": self.url, "reason": self.reason, "detail": self.detail}


@dataclass
class JobResult:
    job: ShardJob
    outcomes: list[RowOutcome]
    duration_s: float


_worker: dict[str, Any] = {}


def init_worker(source: Source, threads: int, preprocess: PreprocessConfig, progress: Any, redactor: Redactor) -> None:
    from PIL import Image

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates workers on interrupt
    Image.MAX_IMAGE_PIXELS = preprocess.max_image_pixels
    _worker.update(fetcher=source.open(threads), threads=threads, preprocess=preprocess, progress=progress,
                   redactor=redactor)


def _sample_meta(row: ManifestRow, outcome: RowOutcome, original: tuple[int, int]) -> dict[str, Any]:
    meta = {f"extra_{k}" if k in _RESERVED_META else k: v for k, v in row.extra.items()}
    meta.update(key=row.key, url=outcome.url, caption=row.caption, status="success", row=row.row,
                sha256=outcome.sha256, original_width=original[0], original_height=original[1],
                width=outcome.width, height=outcome.height)
    return meta


def _process_row(row: ManifestRow, duplicate_of: str | None) -> tuple[RowOutcome, bytes | None, dict | None]:
    redactor: Redactor = _worker["redactor"]
    recorded_url = redactor.url(row.url)
    try:
        outcome, jpeg, meta = _process_row_unguarded(row, duplicate_of, recorded_url)
    except Exception as err:  # one bad row (a codec bug, say) must not cost the shard
        message = redactor.text(f"{type(err).__name__}: {err}")
        log.warning("row %s (%s) failed unexpectedly: %s", row.key, recorded_url, message)
        return RowOutcome(row.row, row.key, recorded_url, "processing_error", message), None, None
    outcome.detail = redactor.text(outcome.detail)  # an error message may quote the URL
    return outcome, jpeg, meta


def _process_row_unguarded(row: ManifestRow, duplicate_of: str | None,
                           recorded_url: str) -> tuple[RowOutcome, bytes | None, dict | None]:
    """The row fetched by its full URL; ``recorded_url`` (redacted) is what its outcome and sample record."""
    outcome = RowOutcome(row.row, row.key, recorded_url)
    preprocess: PreprocessConfig = _worker["preprocess"]
    if duplicate_of is not None:
        outcome.reason, outcome.detail = "duplicate_url", f"same URL as row key {duplicate_of}"
        return outcome, None, None
    if not row.url:
        outcome.reason, outcome.detail = "missing_url", "the URL cell is empty"
        return outcome, None, None
    refusal = caption_refusal(row.caption, preprocess)
    if refusal:
        outcome.reason, outcome.detail = refusal
        return outcome, None, None
    fetched = _worker["fetcher"].fetch(row.url)
    if not fetched.ok:
        outcome.reason, outcome.detail = fetched.reason, fetched.detail
        return outcome, None, None
    outcome.sha256 = hashlib.sha256(fetched.data).hexdigest()
    image = process_image(fetched.data, preprocess)
    if image.jpeg is None:
        outcome.reason, outcome.detail = image.reason, image.detail
        return outcome, None, None
    outcome.width, outcome.height = image.width, image.height
    return outcome, image.jpeg, _sample_meta(row, outcome, (image.original_width, image.original_height))


def run_job(job: ShardJob) -> JobResult:
    start = time.monotonic()
    progress = _worker["progress"]
    outcomes = []
    Path(job.staging).parent.mkdir(parents=True, exist_ok=True)
    # a full disk names the shard being built (its staging file is removed by the main process)
    with (naming_full_disk(Path(job.staging).parent / f"{job.name}.tar"), open(job.staging, "wb") as stream,
          ThreadPoolExecutor(_worker["threads"]) as pool, ShardWriter(stream) as writer):
        results = pool.map(lambda row: _process_row(row, job.duplicate_of.get(row.row)), job.rows)
        for outcome, jpeg, meta in results:  # in row order: the tar's order does not depend on timing
            if jpeg is not None:
                writer.write(outcome.key, jpeg, meta["caption"], meta)
            outcomes.append(outcome)
            if progress is not None:
                progress.put(outcome.reason is None)
    return JobResult(job, outcomes, time.monotonic() - start)

