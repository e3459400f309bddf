"""``cloob data acquire``: the pipeline's first stage. It fixes *which* image-text pairs a run uses, as the run's
manifest (:mod:`cloob_core.data.run_manifest`: parquet parts and an index), so that the gate, the shard build and
DVC's cache all see the same rows.

A packaged set (the captioned default, mnist) becomes rows ``packaged:NAME/SPLIT/INDEX``, fetched from the
package by the shard build. A user's manifest (a file or a folder/prefix of CSV/TSV/parquet/JSONL parts, local or
s3://) is streamed part by part, checked for its URL and caption columns, and stored with all its columns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

from cloob_core import lease, scratch
from cloob_core.config import PACKAGED_SETS, CloobConfig
from cloob_core.data.manifest import list_parts, read_batches
from cloob_core.data.run_manifest import PartSource, RunManifest, frame_part, write_run_manifest
from cloob_core.data.sources import packaged_frame

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcquireResult:
    manifest: str
    rows: int
    parts: int
    parts_reused: int
    source: str


def row_group_rows(shard_size: int, least: int = 1024) -> int:
    """Row groups of whole shards, at least ``least`` rows (a parquet row group much smaller costs more in
    metadata than it saves): a download partition reads the groups of its shards and little else."""
    return shard_size * max(1, -(-least // shard_size))


def _packaged_part(name: str, split: str, url_col: str, caption_col: str) -> PartSource:
    frame, _ = packaged_frame(name, split)  # a few thousand rows
    return frame_part(f"packaged:{name}/{split}", frame.rename(columns={"url": url_col, "caption": caption_col}))


def acquire_into(source: str, output: str, config: CloobConfig, split: str = "train") -> RunManifest:
    """The run manifest of ``source`` (a packaged set's ``split``, or a manifest) written to ``output``."""
    dl = config.download
    if source in PACKAGED_SETS:
        sources = [_packaged_part(source, split, dl.url_col, dl.caption_col)]
    else:
        sources = [PartSource(part.location, part.fingerprint,
                              partial(read_batches, part, dl.url_col, dl.caption_col))
                   for part in list_parts(source, dl.input_format)]
    return write_run_manifest(sources, output, dl.url_col, dl.caption_col,
                              row_group_rows(config.preprocess.shard_size), config.engine)


@lease.holding("output")
def acquire(config: CloobConfig, output: str) -> AcquireResult:
    """Write (or bring up to date) the run manifest in ``output`` for ``config.acquire.source``."""
    settings = config.acquire
    described = f"packaged {settings.source} ({settings.split} split)" if settings.source in PACKAGED_SETS \
        else settings.source
    before = _existing_names(output)
    manifest = acquire_into(settings.source, output, config, settings.split)
    reused = sum(part.name in before and part.source_fingerprint is not None for part in manifest.parts)
    log.debug("acquired %d rows in %d part(s) (%d reused) from %s into %s", len(manifest), len(manifest.parts),
              reused, described, output)
    return AcquireResult(output, len(manifest), len(manifest.parts), reused, described)


def _existing_names(output: str) -> set[str]:
    if not RunManifest.is_one(output):
        return set()
    return {part.name for part in RunManifest.open(output).parts}


@contextlib.contextmanager
def opened(manifest: str | RunManifest, config: CloobConfig) -> Iterator[RunManifest]:
    """The run manifest to build from: ``manifest`` itself when ``cloob data acquire`` wrote it, else a run
    manifest acquired from it into a temporary folder (every run reads the source once more: acquire it once)."""
    if isinstance(manifest, RunManifest):
        yield manifest
        return
    if RunManifest.is_one(manifest):
        opened_manifest = RunManifest.open(manifest)
        try:
            yield opened_manifest
        finally:
            opened_manifest.close()
        return
    with scratch.folder("cloob-manifest") as folder:
        log.debug("reading %s into a run manifest (run `cloob data acquire` once to skip this)", manifest)
        converted = acquire_into(str(manifest), folder, config)
        try:
            yield converted
        finally:
            converted.close()
