"""``cloob data shards``: the download stage's shard layout from local images or a packaged set, so later stages
read one format. Rows go through the download engine with a local source (``sources``) in place of http(s).
"""

from __future__ import annotations

from pathlib import Path

from cloob_core import scratch, storage
from cloob_core.config import PACKAGED_SETS, CloobConfig
from cloob_core.data.acquire import acquire_into, row_group_rows
from cloob_core.data.download import download
from cloob_core.data.manifest import ManifestError, table_folder
from cloob_core.data.run_manifest import RunManifest, frame_part, write_run_manifest
from cloob_core.data.sources import FolderSource, PackagedSource, folder_frame, packaged_source
from cloob_core.data.summary import OutputSummary


def build_shards(source: str, output: str, config: CloobConfig, *, manifest: str | None = None,
                 split: str = "train", progress: bool = True) -> OutputSummary:
    """``source``: a packaged set (its ``split``), or a folder of images with ``<stem>.txt`` captions, or with
    ``manifest`` naming its files in the URL column (relative paths read from the manifest's own folder, the one
    rule of :mod:`cloob_core.data.sources`; every file inside ``source``)."""
    if source not in PACKAGED_SETS and not Path(source).is_dir():
        raise ManifestError(f"--source {source} is neither a packaged set ({', '.join(PACKAGED_SETS)}) nor a folder")
    with scratch.folder("cloob-manifest") as folder:
        fetch_source: FolderSource | PackagedSource
        if source in PACKAGED_SETS:
            rows: str | RunManifest = acquire_into(source, folder, config, split)
            fetch_source = packaged_source(rows.packaged)
        else:
            if manifest and storage.is_s3(manifest):
                raise ManifestError(f"--manifest {manifest} is on S3 but names files in the local folder {source}: "
                                    "put the manifest beside the images")
            rows = manifest or _folder_manifest(source, folder, config)
            fetch_source = FolderSource(str(source), config.download.max_bytes,
                                        base=str(table_folder(manifest)) if manifest else None)
        return download(rows, output, config, progress=progress, source=fetch_source).summary


def _folder_manifest(root: str, folder: str, config: CloobConfig) -> RunManifest:
    """The images of ``root`` with their ``<stem>.txt`` captions as a run manifest in ``folder``."""
    part = frame_part(f"folder:{root}", folder_frame(Path(root)))
    return write_run_manifest([part], folder, "url", "caption", row_group_rows(config.preprocess.shard_size),
                              config.engine)
