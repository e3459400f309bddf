"""What a data set's metrics were computed on, recorded beside them, so that the promotion gate compares production
and a candidate only when both were evaluated on the same suite (:func:`cloob_core.evaluation.suite_report.
suite_fingerprint` puts the data sets' together).

A data set's fingerprint holds the settings that change its figures (source, splits, tasks, class names and
templates, label key, few-shot K; not the batch size) and what is known of its source's content without reading
it: the packaged sets' images, captions and classes; on S3 each object's ETag and size; on local disk each file's
path, size and modification time (what make and DVC's own state check use to tell a changed file).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cloob_core import storage
from cloob_core.config import PACKAGED_SOURCES, DatasetConfig
from cloob_core.evaluation.class_sets import packaged_class_set, packaged_class_sets
from cloob_core.io import json_digest


def _packaged(source: str) -> str:
    import numpy as np

    digest = hashlib.sha256()
    if source == "sklearn-digits":
        from sklearn.datasets import load_digits

        data = load_digits()
        for array in (data.images, data.target):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()
    from cloob_core.data.packaged import SPLITS, load_packaged

    for split in SPLITS:
        part = load_packaged(source, split)
        for image in part.images:
            digest.update(hashlib.sha256(image).digest())
        digest.update(json.dumps([part.captions, part.labels, part.classnames, part.templates]).encode())
    return digest.hexdigest()


def source_content(source: str) -> dict[str, str]:
    """The digest of a source's content where it can be known without reading it, and how it was taken."""
    if source in PACKAGED_SOURCES:
        return {"kind": "packaged", "digest": _packaged(source)}
    if not storage.is_s3(source) and Path(source).is_file():  # an image,caption .csv
        return {"kind": "stat", "digest": json_digest([[Path(source).name, Path(source).stat().st_size,
                                                   str(Path(source).stat().st_mtime_ns)]])}
    return {"kind": "etag" if storage.is_s3(source) else "stat", "digest": json_digest(storage.tree_entries(source))}


def _class_list(name: str | None) -> dict[str, str] | None:
    if name is None:
        return None
    text = packaged_class_set(name) if name in packaged_class_sets() else storage.read_bytes(name).decode("utf-8")
    return {"name": name, "digest": hashlib.sha256(text.encode()).hexdigest()}


def dataset_fingerprint(entry: DatasetConfig) -> dict[str, Any]:
    return {"source": entry.source, "content": source_content(entry.source), "tasks": sorted(entry.tasks),
            "splits": entry.splits.model_dump(), "classnames": _class_list(entry.classnames),
            "label_key": entry.label_key, "few_shot": entry.few_shot}
