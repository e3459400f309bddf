"""``cloob data download``: a manifest to WebDataset shards, resumable after any kill, never hanging.

Work is cut into shards of ``shard_size`` manifest rows. Worker processes each take one shard and fetch its rows
with a pool of threads (downloader → resizer), writing a staging tar. The main process then finalises shards
strictly in shard order: it drops content already seen in earlier shards, publishes the tar (rename or
upload), then the failures, then the stats file that marks the shard complete. Because finalisation is ordered
and every publish is atomic, the completed shards always form a prefix of the plan, and a re-run after
``kill -9`` or SIGTERM skips them and produces exactly what an uninterrupted run would have.

A run holds its partition's lease on the folder (:mod:`cloob_core.lease`) for as long as it runs, and every
temporary file names its shard. So a run removes only what an earlier, dead run of its own partition left: never a
user's file, never another partition's staging tar or record. Different partitions write to one folder side by
side; a second run of the same partition is refused at once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cloob_core import lease, memory_limit, scratch, storage
from cloob_core.config import CloobConfig
from cloob_core.data.acquire import opened
from cloob_core.data.fetch import FetchPolicy
from cloob_core.data.manifest import ManifestError, Partition, row_key
from cloob_core.data.plan import (
    Plan,
    check_settings,
    fetch_digest,
    plan_round,
    retry_plan_name,
    retry_round,
    settings_of,
)
from cloob_core.data.run_manifest import RunManifest
from cloob_core.data.sources import HttpSource, Source, packaged_source
from cloob_core.data.summary import OutputSummary, format_summary, merge_stats, summarize
from cloob_core.data.worker import JobResult, ShardJob, init_worker, run_job
from cloob_core.data.writer import (
    FAILURES_SUFFIX,
    STATS_SUFFIX,
    ShardRecord,
    copy_without,
    jsonl_bytes,
    parse_shard_name,
    read_records,
)
from cloob_core.errors import StageError
from cloob_core.io import json_bytes
from cloob_core.pushgateway import push_download_summary, run_label
from cloob_core.redact import Redactor
from cloob_core.threads import usable_cores

log = logging.getLogger(__name__)


class DownloadInterrupted(StageError):
    """SIGINT/SIGTERM arrived; completed shards are kept and a re-run resumes."""

    exit_code = 130


class WorkerDied(StageError):
    """A worker process ended without a result (killed for memory, a crashing codec)."""


@dataclass
class DownloadResult:
    output: str
    summary: OutputSummary | None
    shards_done: int
    shards_skipped: int
    seconds: float
    partition: Partition = field(default_factory=Partition)


def _remove_leftovers(output: str, owned: range) -> None:
    """What an earlier, killed run of the same partition left half written in a local folder: staging tars and
    temporaries of its shards' records. (On S3 the staging lies in a private temporary folder, and an S3 object
    appears only whole.)"""
    if storage.is_s3(output):
        return
    for path in Path(output).glob(".*.tmp"):
        shard = parse_shard_name(re.split(r"[._]", path.name[1:], maxsplit=1)[0])  # .NAME.tar…, .NAME_stats…
        if shard is not None and shard[0] in owned:
            log.info("removing %s left by an interrupted run", path.name)
            path.unlink(missing_ok=True)


class _Progress:
    """A tqdm bar fed by the workers through a queue: rows done, rate and success ratio."""

    def __init__(self, total: int, enabled: bool, context: Any, what: str):
        from tqdm.auto import tqdm

        self.queue = context.Queue() if enabled else None
        interactive = sys.stderr.isatty()  # in a pod's log, one line every 30 s rather than a redrawn bar
        self.bar = tqdm(total=total, unit="img", desc=what, disable=not enabled, dynamic_ncols=interactive,
                        mininterval=0.1 if interactive else 30.0)
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
    """Publishes shards in plan order, dropping content seen in any earlier shard; each under the partition's
    lease (``owner``), checked before the shard's files appear and before its completion mark."""

    def __init__(self, output: str, owner: str, dedup_content: bool, seen: dict[bytes, str], fetch: str):
        self.output, self.owner, self.dedup_content, self.seen, self.fetch = output, owner, dedup_content, seen, fetch

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
            failures_by_reason=dict(sorted(reasons.items())), tar=tar_name,
            samples=[[o.key, o.sha256] for o in kept],
            image_sides={"min": min(sides), "max": max(sides)} if sides else {},
            tar_bytes=staging.stat().st_size if kept else 0, fetch=self.fetch,
        )
        lease.check_held(self.output, self.owner)
        storage.write_bytes(storage.join(self.output, job.name + FAILURES_SUFFIX), jsonl_bytes(failures))
        if kept:
            storage.upload_file(staging, storage.join(self.output, tar_name))
        else:
            staging.unlink(missing_ok=True)
        stats = storage.join(self.output, job.name + STATS_SUFFIX)
        lease.check_held(self.output, self.owner)
        storage.write_bytes(stats, json_bytes(record.to_json()))  # the completion mark
        log.debug("shard %s: %d of %d rows in %.1f s", job.name, len(kept), len(job.rows), result.duration_s)
        return record


def download(
    manifest: str | RunManifest,
    output: str,
    config: CloobConfig,
    *,
    partition: Partition | None = None,
    retry_failed: bool = False,
    progress: bool = True,
    source: Source | None = None,
) -> DownloadResult:
    """Build (or finish building) the shards of ``manifest`` in ``output``; see the module docstring.

    ``source`` says how a row's URL becomes bytes (:class:`~cloob_core.data.sources.Source`); the default
    fetches http(s) under ``config.download``. Local folders and the packaged sets plug in here. The
    outcome is pushed to ``download.pushgateway`` (when set), per partition.
    """
    started = time.monotonic()
    partition = partition or Partition()
    dl = config.download
    if partition.count > 1 and isinstance(manifest, str) and not RunManifest.is_one(manifest):
        raise ManifestError(
            f"--partition {partition.index}/{partition.count} of {manifest}, a manifest `cloob data acquire` did not "
            f"write: each of the {partition.count} partitions would read and acquire the whole of it to build its "
            f"share; acquire it once (`cloob data acquire --source {manifest} --output DIR`, with its --url-col / "
            "--caption-col) and give the partitions --manifest DIR")
    storage.ensure_folder(output)
    owner = f"p{partition.index}of{partition.count}"  # the partition's lease, and its staging names' mark
    with lease.writing(output, owner, f"partition {partition.index}/{partition.count} of {output}"), \
            opened(manifest, config) as manifest:
        owned = partition.shards(manifest.shard_count(config.preprocess.shard_size))
        _remove_leftovers(output, owned)
        if source is None:
            source = packaged_source(manifest.packaged) if manifest.all_packaged else \
                HttpSource(FetchPolicy.from_config(dl))
        check_settings(output, settings_of(manifest, config))
        records = read_records(output, owned.__contains__)
        round_, plan = _round_and_plan(manifest, output, records, partition, owned, retry_failed,
                                       config.preprocess.shard_size, fetch_digest(config))
        planned = {name for name, _, _ in plan}
        skipped = sum(1 for r in records if r.round == round_ and r.name not in planned)
        if skipped:
            log.info("resuming: %d shard(s) already complete are skipped", skipped)
        run = _Run(manifest, output, config, source, owner, progress)
        done = _build_planned(run, records, round_, plan, complete_before=skipped)
    # one partition: the whole output's files; else this partition's view (`cloob data merge-stats` merges them)
    summary = merge_stats(output) if partition.count == 1 else \
        summarize(output, read_records(output, owned.__contains__))
    push_download_summary(dl.pushgateway, summary.stats, f"{partition.index}-{partition.count}", run_label(output))
    _check_success(summary, config.validation.min_success_ratio, output)
    return DownloadResult(output, summary, done, skipped, time.monotonic() - started, partition)


class DownloadFailed(StageError):
    """Fewer rows became samples than the data gate accepts: the run is told as failed, not as shards built."""


# What to do about the reason most rows failed for (the others: failures.jsonl has each row's)
_FIXES = {
    "blocked_address": "the URLs point at private, loopback or link-local addresses, which are refused unless "
                       "they are yours to fetch: --allow-private-network (download.allow_private_network)",
    "empty_caption": "the images have no captions: give each a caption (IMAGE.txt beside it, or a --manifest with "
                     "a caption column named by --caption-col)",
    "missing_file": "the files are not where the manifest says: relative paths are read from the manifest's own "
                    "folder (failures.jsonl names each row's file)",
    "blocked_path": "the paths leave the --source folder",
    "dns_error": "the hosts' names do not resolve from here: check the network (a proxy, DNS)",
    "connection_error": "the hosts cannot be reached from here: check the network",
    "timeout": "the hosts answer too slowly: raise download.connect_timeout / download.read_timeout",
    "deadline_exceeded": "the downloads take too long: raise download.url_deadline",
}


def _check_success(summary: OutputSummary, threshold: float, output: str) -> None:
    """:class:`DownloadFailed` naming the dominant reason and its fix when the share of rows that became samples
    is below ``validation.min_success_ratio``; the shards stay, and ``--retry-failed`` re-attempts the rows."""
    stats = summary.stats
    if not stats["rows"] or stats["success_ratio"] >= threshold:
        return
    reason, count = next(iter(stats["failures_by_reason"].items()), ("unknown", 0))
    fix = _FIXES.get(reason, f"see {storage.join(output, 'failures.jsonl')}")
    failure = DownloadFailed(
        f"{stats['successes']} of {stats['rows']} rows became samples ({stats['success_ratio']:.0%}, below "
        f"validation.min_success_ratio {threshold:g}); {count} failed as {reason}: {fix}; the shards are kept: "
        "once it is fixed, run again with --retry-failed")
    failure.details = format_summary(summary)
    raise failure


def _round_and_plan(manifest: RunManifest, output: str, records: list[ShardRecord], partition: Partition,
                    owned: range, retry_failed: bool, shard_size: int, fetch: str) -> tuple[int, Plan]:
    """The first pass, or with ``retry_failed`` the retry round to run (recorded, so a killed round resumes)."""
    if not retry_failed:
        return 0, plan_round(manifest, output, records, owned, 0, shard_size, fetch)
    missing = plan_round(manifest, output, records, owned, 0, shard_size)  # a retry re-attempts the failed rows
    if missing:
        raise ManifestError(f"{len(missing)} shard(s) of the first pass are not complete yet; re-run without "
                            "--retry-failed to finish them, then retry")
    round_ = retry_round(output, partition, records)
    plan = plan_round(manifest, output, records, owned, round_, shard_size)
    if not plan:
        log.info("nothing to retry: no failed rows other than duplicates")
        return round_, plan
    plan_file = storage.join(output, retry_plan_name(round_, partition))
    if not storage.exists(plan_file):
        storage.write_bytes(plan_file, json_bytes({"round": round_, "shards": [name for name, _, _ in plan]}))
    log.info("retry round %d: %d row(s) in %d shard(s)", round_, sum(len(r) for _, _, r in plan), len(plan))
    return round_, plan


@dataclass(frozen=True)
class _Run:
    """One call of :func:`download`: what each of its shards is built with."""

    manifest: RunManifest
    output: str
    config: CloobConfig
    source: Source
    owner: str  # the partition: its lease's holder, and the mark on its staging files
    progress: bool


def _build_planned(run: _Run, records: list[ShardRecord], round_: int, plan: Plan, *, complete_before: int) -> int:
    """Build the planned shards in worker processes and publish them in plan order; how many were built."""
    manifest, output, source, owner, progress = run.manifest, run.output, run.source, run.owner, run.progress
    dl, pre = run.config.download, run.config.preprocess
    staging_dir = Path(output) if not storage.is_s3(output) else scratch.new_folder("cloob-staging")
    seen = {_digest_key(sha): key for r in records for key, sha in r.samples} if pre.dedup_content else {}
    finaliser = _Finaliser(output, owner, pre.dedup_content, seen, fetch_digest(run.config))

    def staging(name: str) -> str:
        return str(staging_dir / f".{name}.tar.{owner}.{os.getpid()}.tmp")

    # the repeated URLs of the plan's rows, read once (a partition's rows are one contiguous span)
    spans = [rows for _, _, rows in plan if rows]
    earlier = manifest.duplicates_between(min(r[0] for r in spans), max(r[-1] for r in spans) + 1) \
        if dl.dedup_urls and spans else {}

    def jobs() -> Iterator[ShardJob]:  # built as submitted: only the shards in flight are in memory
        for name, shard, rows in plan:
            duplicates = {row: row_key(earlier[row]) for row in rows if row in earlier}
            yield ShardJob(name, shard, round_, manifest.rows(list(rows)), duplicates, staging(name))

    processes = min(dl.processes or usable_cores(), max(1, len(plan)))
    bar = _Progress(sum(len(rows) for _, _, rows in plan), progress and bool(plan), _CONTEXT,
                    "download" if isinstance(source, HttpSource) else "shards")  # local images: nothing downloads
    done = 0
    try:
        with _interrupts_raise():
            worker_args = (source, dl.threads, pre, bar.queue, Redactor.of(dl.redact_query_params))
            for result in _run_in_workers(jobs(), processes, worker_args):
                finaliser.publish(result)
                done += 1
    except (KeyboardInterrupt, DownloadInterrupted) as err:
        raise DownloadInterrupted(f"{err or 'interrupted'}: {complete_before + done} shard(s) complete, kept; "
                                  "re-run the same command to resume") from None
    finally:
        bar.close()
        for name, _, _ in plan:
            Path(staging(name)).unlink(missing_ok=True)
        if storage.is_s3(output):
            shutil.rmtree(staging_dir, ignore_errors=True)
    return done


_CONTEXT = multiprocessing.get_context("spawn")  # no fork: the parent may hold threads, locks, boto3 clients


def worker_death(shard: str, kills_before: int | None) -> str:
    """Why a worker process died while building ``shard``: killed for memory when the cgroup's OOM kills rose
    since the pool started (naming the limit and the settings), else unknown."""
    kills = memory_limit.oom_kills()
    if kills is not None and kills_before is not None and kills > kills_before:
        return (f"a worker process was killed for memory while building shard {shard}: the memory limit "
                f"({memory_limit.limit_text()}) is too small for its workers (about 170 MB each, docs/scale.md); "
                "give the download pods more (cluster setting download_memory, `compile --download-memory`) or "
                "fewer workers (download.processes); completed shards are kept, and a retry resumes")
    return (f"a worker process died while building shard {shard} (out of memory? a crashing codec?); completed "
            "shards are kept, re-run the same command to resume")


def _run_in_workers(jobs: Iterator[ShardJob], processes: int, worker_args: tuple) -> Iterator[JobResult]:
    """Results in job order, at most two jobs per process ahead of the one being published.

    A worker that dies (out of memory, a crash in a codec) is reported, never waited for forever.
    """
    executor = ProcessPoolExecutor(processes, mp_context=_CONTEXT, initializer=init_worker, initargs=worker_args)
    kills = memory_limit.oom_kills()
    pending: deque[tuple[ShardJob, Future]] = deque()
    upcoming = jobs
    try:
        while True:
            while len(pending) < 2 * processes and (job := next(upcoming, None)) is not None:
                pending.append((job, executor.submit(run_job, job)))
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
                    raise WorkerDied(worker_death(job.name, kills)) from None
            yield result
    finally:
        for process in list(getattr(executor, "_processes", {}).values()):
            if process.is_alive():
                process.terminate()
        executor.shutdown(wait=True, cancel_futures=True)


