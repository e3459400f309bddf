"""``cloob data download``: a manifest to WebDataset shards, resumable after any kill, never hanging.

Work is cut into shards of ``shard_size`` manifest rows. Worker processes each take one shard and fetch its rows
with a pool of threads (downloader → resizer), writing a staging tar. The main process then finalises shards
strictly in shard order: it drops content already seen in earlier shards, publishes the tar (rename or
upload), then the failures, then the stats file that marks the shard complete. Because finalisation is ordered
and every publish is atomic, the completed shards always form a prefix of the plan, and a re-run after
``kill -9`` or SIGTERM skips them and produces exactly what an uninterrupted run would have.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import re
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloob_core import storage
from cloob_core.config import CloobConfig, PreprocessConfig
from cloob_core.data.fetch import Fetcher, FetchPolicy
from cloob_core.data.imaging import caption_refusal, process_image
from cloob_core.data.manifest import Manifest, ManifestError, ManifestRow, Partition, row_key
from cloob_core.data.shards import (
    FAILURES_SUFFIX,
    STATS_SUFFIX,
    ShardRecord,
    ShardWriter,
    copy_without,
    jsonl_bytes,
    read_records,
    shard_name,
)
from cloob_core.data.summary import NOT_RETRIED, OutputSummary, latest_failures, merge_stats, summarize

log = logging.getLogger(__name__)
_RESERVED_META = ("key", "url", "caption", "status", "row", "sha256", "original_width", "original_height",
                  "width", "height")


class DownloadInterrupted(RuntimeError):
    """SIGINT/SIGTERM arrived; completed shards are kept and a re-run resumes."""


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
    url: str
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


@dataclass
class DownloadResult:
    output: str
    summary: OutputSummary | None
    shards_done: int
    shards_skipped: int
    seconds: float
    partition: Partition = field(default_factory=Partition)


# ---------------------------------------------------------------- worker side (one process per shard at a time)

_worker: dict[str, Any] = {}


@dataclass(frozen=True)
class HttpSource:
    """Rows name http(s) URLs; fetched under the download policy."""

    policy: FetchPolicy

    def open(self, threads: int) -> Fetcher:
        return Fetcher(self.policy, pool_size=threads)


def _init_worker(source: Any, threads: int, preprocess: PreprocessConfig, progress: Any) -> None:
    from PIL import Image

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides; it terminates workers on interrupt
    Image.MAX_IMAGE_PIXELS = preprocess.max_image_pixels
    _worker.update(fetcher=source.open(threads), threads=threads, preprocess=preprocess, progress=progress)


def _sample_meta(row: ManifestRow, outcome: RowOutcome, original: tuple[int, int]) -> dict[str, Any]:
    meta = {f"extra_{k}" if k in _RESERVED_META else k: v for k, v in row.extra.items()}
    meta.update(key=row.key, url=row.url, caption=row.caption, status="success", row=row.row,
                sha256=outcome.sha256, original_width=original[0], original_height=original[1],
                width=outcome.width, height=outcome.height)
    return meta


def _process_row(row: ManifestRow, duplicate_of: str | None) -> tuple[RowOutcome, bytes | None, dict | None]:
    try:
        return _process_row_unguarded(row, duplicate_of)
    except Exception as err:  # one bad row (a codec bug, say) must not cost the shard
        log.exception("row %s (%s) failed unexpectedly", row.key, row.url)
        outcome = RowOutcome(row.row, row.key, row.url, "processing_error", f"{type(err).__name__}: {err}")
        return outcome, None, None


def _process_row_unguarded(row: ManifestRow, duplicate_of: str | None) -> tuple[RowOutcome, bytes | None, dict | None]:
    outcome = RowOutcome(row.row, row.key, row.url)
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


def _run_job(job: ShardJob) -> JobResult:
    start = time.monotonic()
    progress = _worker["progress"]
    outcomes = []
    Path(job.staging).parent.mkdir(parents=True, exist_ok=True)
    with open(job.staging, "wb") as stream, ThreadPoolExecutor(_worker["threads"]) as pool:
        writer = ShardWriter(stream)
        results = pool.map(lambda row: _process_row(row, job.duplicate_of.get(row.row)), job.rows)
        for outcome, jpeg, meta in results:  # in row order: the tar's order does not depend on timing
            if jpeg is not None:
                writer.write(outcome.key, jpeg, meta["caption"], meta)
            outcomes.append(outcome)
            if progress is not None:
                progress.put(outcome.reason is None)
        writer.close()
    return JobResult(job, outcomes, time.monotonic() - start)


# ---------------------------------------------------------------- main process


def _plan_round(manifest: Manifest, output: str, records: list[ShardRecord], partition: Partition,
                round_: int, shard_size: int, dedup_urls: bool) -> list[tuple[str, int, list[int]]]:
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


def _retry_plan_name(round_: int, partition: Partition) -> str:
    return f"round-{round_:02d}{partition.suffix}.retry-plan.json"


def _retry_round(output: str, partition: Partition, records: list[ShardRecord]) -> int:
    """The retry round to run: an unfinished one (resume) or the next one."""
    pattern = re.compile(r"round-(\d+)" + re.escape(partition.suffix) + r"\.retry-plan\.json")
    rounds = [int(m.group(1)) for name in storage.list_names(output) if (m := pattern.fullmatch(name))]
    if rounds:
        last = max(rounds)
        planned = _read_json(storage.join(output, _retry_plan_name(last, partition)))
        done = {r.name for r in records}
        if any(name not in done for name in planned["shards"]):
            return last
        return last + 1
    return 1


SETTINGS_FILE = "download_settings.json"


class SettingsMismatch(ValueError):
    """The output folder was started with another manifest or other shard-shaping settings."""


def _settings_of(manifest: Manifest, config: CloobConfig) -> dict[str, Any]:
    """What decides the content of the shards; a resume must use exactly these (timeouts may change)."""
    return {
        "manifest_rows": len(manifest),
        "manifest_sha256": manifest.fingerprint(),
        "dedup_urls": config.download.dedup_urls,
        "preprocess": config.preprocess.model_dump(),
    }


def _check_settings(output: str, settings: dict[str, Any]) -> None:
    location = storage.join(output, SETTINGS_FILE)
    try:
        recorded = _read_json(location)
    except FileNotFoundError:
        storage.write_bytes(location, _json_bytes(settings))
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


def _read_json(location: str) -> Any:
    return json.loads(storage.read_bytes(location))


def _clean_stale_staging(output: str) -> None:
    if storage.is_s3(output):
        return
    for path in Path(output).glob(".*.tmp"):
        log.info("removing %s left by an interrupted run", path.name)
        path.unlink(missing_ok=True)


class _Progress:
    """A tqdm bar fed by the workers through a queue: rows done, rate and success ratio."""

    def __init__(self, total: int, enabled: bool, context: Any):
        from tqdm.auto import tqdm

        self.queue = context.Queue() if enabled else None
        self.bar = tqdm(total=total, unit="img", desc="download", disable=not enabled, dynamic_ncols=True)
        self.ok = self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True) if enabled else None
        if self._thread:
            self._thread.start()

    def _pump(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            try:
                success = self.queue.get(timeout=0.2)
            except (queue.Empty, OSError, EOFError, ValueError):
                continue
            self.done += 1
            self.ok += bool(success)
            self.bar.update(1)
            if time.monotonic() - last > 0.5:
                self.bar.set_postfix(success=f"{100 * self.ok / self.done:.1f}%", refresh=False)
                last = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)
        self.bar.close()


@contextlib.contextmanager
def _interrupts_raise() -> Any:
    """SIGTERM (Kubernetes stopping the pod) behaves like Ctrl-C: stop, keep what is complete."""

    def handler(signum: int, _frame: Any) -> None:
        raise DownloadInterrupted(f"received {signal.Signals(signum).name}")

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        for sig in previous:
            signal.signal(sig, handler)
    try:
        yield
    finally:
        if in_main:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _digest_key(sha256_hex: str) -> bytes:
    """128 bits of the sha256 as the dedup key: collision-free in practice, a third of the hex string's memory
    (CC3M's 3.3M images fit in a few hundred MB)."""
    return bytes.fromhex(sha256_hex[:32])


class _Finaliser:
    """Publishes shards in plan order, dropping content seen in any earlier shard."""

    def __init__(self, output: str, staging_dir: Path, dedup_content: bool, seen: dict[str, str]):
        self.output, self.staging_dir, self.dedup_content, self.seen = output, staging_dir, dedup_content, seen

    def publish(self, result: JobResult) -> ShardRecord:
        job = result.job
        staging = Path(job.staging)
        drop: set[str] = set()
        for outcome in result.outcomes:
            if outcome.reason is not None or not self.dedup_content:
                continue
            digest = _digest_key(outcome.sha256)
            first = self.seen.get(digest)
            if first is not None:
                outcome.reason, outcome.detail = "duplicate_content", f"same image bytes as key {first}"
                drop.add(outcome.key)
            else:
                self.seen[digest] = outcome.key
        kept = [o for o in result.outcomes if o.reason is None]
        if drop:
            filtered = staging.with_name(staging.name + ".dedup.tmp")
            copy_without(staging, filtered, drop)
            os.replace(filtered, staging)
        failures = [o.failure() for o in result.outcomes if o.reason is not None]
        reasons = Counter(o.reason for o in result.outcomes if o.reason is not None)
        tar_name = f"{job.name}.tar" if kept else None
        sides = [s for o in kept for s in (o.width, o.height)]
        record = ShardRecord(
            name=job.name, shard=job.shard, round=job.round, rows=len(job.rows), successes=len(kept),
            failures_by_reason=dict(sorted(reasons.items())), duration_s=result.duration_s, tar=tar_name,
            samples=[[o.key, o.sha256] for o in kept],
            image_sides={"min": min(sides), "max": max(sides)} if sides else {},
            tar_bytes=staging.stat().st_size if kept else 0,
        )
        storage.write_bytes(storage.join(self.output, job.name + FAILURES_SUFFIX), jsonl_bytes(failures))
        if kept:
            storage.upload_file(staging, storage.join(self.output, tar_name))
        else:
            staging.unlink(missing_ok=True)
        stats = (json.dumps(record.to_json(), indent=1, sort_keys=True) + "\n").encode()
        storage.write_bytes(storage.join(self.output, job.name + STATS_SUFFIX), stats)  # the completion mark
        return record


def download(
    manifest: str | Manifest,
    output: str,
    config: CloobConfig,
    partition: Partition | None = None,
    retry_failed: bool = False,
    progress: bool = True,
    source: Any = None,
) -> DownloadResult:
    """Build (or finish building) the shards of ``manifest`` in ``output``; see the module docstring.

    ``source`` says how a row's URL becomes bytes (``open(threads)`` → an object with ``fetch(url)``); the
    default fetches http(s) under ``config.download``. Local folders and the embedded set plug in here.
    """
    started = time.monotonic()
    partition = partition or Partition()
    dl, pre = config.download, config.preprocess
    if not isinstance(manifest, Manifest):
        manifest = Manifest.load(manifest, dl.url_col, dl.caption_col, dl.input_format)
    source = source or HttpSource(FetchPolicy.from_config(dl))
    storage.ensure_folder(output)
    _check_settings(output, _settings_of(manifest, config))
    _clean_stale_staging(output)
    records = [r for r in read_records(output) if partition.owns(r.shard)]

    if retry_failed:
        missing = _plan_round(manifest, output, records, partition, 0, pre.shard_size, dl.dedup_urls)
        if missing:
            raise ManifestError(f"{len(missing)} shard(s) of the first pass are not complete yet; re-run without "
                                "--retry-failed to finish them, then retry")
        round_ = _retry_round(output, partition, records)
    else:
        round_ = 0
    plan = _plan_round(manifest, output, records, partition, round_, pre.shard_size, dl.dedup_urls)
    if round_ > 0 and plan:
        plan_file = storage.join(output, _retry_plan_name(round_, partition))
        if not storage.exists(plan_file):
            storage.write_bytes(plan_file, _json_bytes({"round": round_, "shards": [name for name, _, _ in plan]}))
        log.info("retry round %d: %d row(s) in %d shard(s)", round_, sum(len(r) for _, _, r in plan), len(plan))
    elif round_ > 0:
        log.info("nothing to retry: no failed rows other than duplicates")
    skipped = sum(1 for r in records if r.round == round_)
    if skipped:
        log.info("resuming: %d shard(s) already complete are skipped", skipped)

    staging_dir = Path(output) if not storage.is_s3(output) else Path(tempfile.mkdtemp(prefix="cloob-staging-"))
    seen = {_digest_key(sha): key for r in records for key, sha in r.samples} if pre.dedup_content else {}
    finaliser = _Finaliser(output, staging_dir, pre.dedup_content, seen)
    first_row = manifest.first_row_of_url

    def staging(name: str) -> str:
        return str(staging_dir / f".{name}.tar.{os.getpid()}.tmp")

    def jobs() -> Iterator[ShardJob]:  # built as submitted: a 10M-row manifest is never all rows in memory
        for name, shard, rows in plan:
            duplicates = {r: row_key(int(first_row[r])) for r in rows if dl.dedup_urls and first_row[r] != r}
            yield ShardJob(name, shard, round_, manifest.rows(rows), duplicates, staging(name))

    processes = min(dl.processes or os.cpu_count() or 1, max(1, len(plan)))
    bar = _Progress(sum(len(rows) for _, _, rows in plan), progress and bool(plan), _CONTEXT)
    done = 0
    try:
        with _interrupts_raise():
            for result in _run_in_workers(jobs(), processes, (source, dl.threads, pre, bar.queue)):
                finaliser.publish(result)
                done += 1
    except (KeyboardInterrupt, DownloadInterrupted) as err:
        raise DownloadInterrupted(
            f"{err or 'interrupted'}: {skipped + done} shard(s) complete, kept; re-run the same command to resume"
        ) from None
    finally:
        bar.close()
        for name, _, _ in plan:
            Path(staging(name)).unlink(missing_ok=True)
        if storage.is_s3(output):
            shutil.rmtree(staging_dir, ignore_errors=True)

    if partition.count == 1:
        summary = merge_stats(output)
    else:  # this partition's view; the merged whole-output files come from `cloob data merge-stats`
        summary = summarize(output, [r for r in read_records(output) if partition.owns(r.shard)])
    return DownloadResult(output, summary, done, skipped, time.monotonic() - started, partition)


_CONTEXT = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads, locks, boto3 clients


def _run_in_workers(jobs: Iterator[ShardJob], processes: int, worker_args: tuple) -> Iterator[JobResult]:
    """Results in job order, at most two jobs per process ahead of the one being published.

    A worker that dies (out of memory, a crash in a codec) is reported, never waited for forever.
    """
    executor = ProcessPoolExecutor(processes, mp_context=_CONTEXT, initializer=_init_worker, initargs=worker_args)
    pending: deque[tuple[ShardJob, Future]] = deque()
    upcoming = jobs
    try:
        while True:
            while len(pending) < 2 * processes and (job := next(upcoming, None)) is not None:
                pending.append((job, executor.submit(_run_job, job)))
            if not pending:
                break
            job, future = pending.popleft()
            while True:
                try:
                    result = future.result(timeout=0.5)  # short waits keep signals responsive
                    break
                except FutureTimeout:
                    continue
                except BrokenProcessPool:
                    raise RuntimeError(
                        f"a worker process died while building shard {job.name} (out of memory? a crashing "
                        "codec?); completed shards are kept, re-run the same command to resume"
                    ) from None
            yield result
    finally:
        for process in list(getattr(executor, "_processes", {}).values()):
            if process.is_alive():
                process.terminate()
        executor.shutdown(wait=True, cancel_futures=True)


def _json_bytes(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
