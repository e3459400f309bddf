"""``cloob data acquire``: the pipeline's first stage. It fixes *which* image-text pairs a run uses, as one
manifest file, so that the gate, the shard build and DVC's cache all see the same rows.

A packaged set (the captioned default, mnist) becomes rows ``packaged:NAME/SPLIT/INDEX``, fetched from the
package by the shard build. A user's manifest (CSV/TSV/parquet/JSONL, local or s3://) is read, checked for its
URL and caption columns, and stored as parquet with all its columns.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass

from cloob_core import lease, storage
from cloob_core.config import PACKAGED_SETS, CloobConfig
from cloob_core.data.manifest import read_manifest
from cloob_core.data.sources import packaged_frame

log = logging.getLogger(__name__)
MANIFEST_NAME = "manifest.parquet"


@dataclass(frozen=True)
class AcquireResult:
    manifest: str
    rows: int
    source: str


@lease.holding("output")
def acquire(config: CloobConfig, output: str) -> AcquireResult:
    """Write ``OUTPUT/manifest.parquet`` for ``config.acquire.source``."""
    settings, dl = config.acquire, config.download
    if settings.source in PACKAGED_SETS:
        frame, _ = packaged_frame(settings.source, settings.split)
        frame = frame.rename(columns={"url": dl.url_col, "caption": dl.caption_col})
        described = f"packaged {settings.source} ({settings.split} split)"
    else:
        frame = read_manifest(settings.source, dl.url_col, dl.caption_col, dl.input_format)
        described = settings.source
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    storage.ensure_folder(output)
    location = storage.join(output, MANIFEST_NAME)
    storage.write_bytes(location, buffer.getvalue())
    log.debug("acquired %d rows from %s into %s", len(frame), described, location)
    return AcquireResult(location, len(frame), described)
