"""``cloob data shards``: the download stage's shard layout from local images or a packaged set, so later stages
read one format. Rows go through the download engine with a local source (``sources``) in place of http(s).
"""

from __future__ import annotations

from pathlib import Path

from cloob_core.config import PACKAGED_SETS, CloobConfig
from cloob_core.data.download import download
from cloob_core.data.manifest import Manifest, ManifestError, read_manifest
from cloob_core.data.sources import FolderSource, folder_frame, packaged_frame
from cloob_core.data.summary import OutputSummary


def build_shards(source: str, output: str, config: CloobConfig, *, manifest: str | None = None,
                 split: str = "train", progress: bool = True) -> OutputSummary:
    """``source``: a packaged set (its ``split``), or a folder of images with ``<stem>.txt`` captions, or with
    ``manifest`` naming its files (relative paths in the URL column)."""
    if source in PACKAGED_SETS:
        (frame, fetch_source), url_col, caption_col = packaged_frame(source, split), "url", "caption"
    else:
        root = Path(source)
        if not root.is_dir():
            raise ManifestError(f"--source {source} is neither a packaged set ({', '.join(PACKAGED_SETS)}) nor a "
                                "folder")
        if manifest:
            dl = config.download
            frame = read_manifest(manifest, dl.url_col, dl.caption_col, dl.input_format)
            url_col, caption_col = dl.url_col, dl.caption_col
        else:
            frame, url_col, caption_col = folder_frame(root), "url", "caption"
        fetch_source = FolderSource(str(root), config.download.max_bytes)
    result = download(Manifest(frame, url_col, caption_col), output, config, progress=progress, source=fetch_source)
    return result.summary
