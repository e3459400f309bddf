"""What a data set's metrics were computed on, recorded beside them, so that the promotion gate compares production
and a candidate only when both were evaluated on the same suite (:func:`cloob_core.evaluation.suite_report.
suite_fingerprint` puts the data sets' together).

A data set's fingerprint holds the settings that change its figures (source, splits, tasks, class names and
templates, label key, few-shot K; not the batch size) and what is known of its source's content without reading
it: the packaged sets' arrays; on S3 each object's ETag and size; on local disk each file's path, size and
modification time (what make and DVC's own state check use to tell a changed file).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from cloob_core import storage
from cloob_core.config import PACKAGED_SOURCES, DatasetConfig
from cloob_core.evaluation.class_sets import packaged_class_set, packaged_class_sets
from cloob_core.evaluation.suite_report import digest


def _packaged(source: str) -> str:
    import numpy as np

    if source == "embedded":
        from cloob_core.data.embedded import load_embedded

        parts = [load_embedded(split) for split in ("train", "test")]
        arrays = [a for part in parts for a in (part.images, part.labels)]
    else:
        from sklearn.datasets import load_digits

        data = load_digits()
        arrays = [data.images, data.target]
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def source_content(source: str) -> dict[str, str]:
    """The digest of a source's content where it can be known without reading it, and how it was taken."""
    if source in PACKAGED_SOURCES:
        return {"kind": "arrays", "digest": _packaged(source)}
    if not storage.is_s3(source) and Path(source).is_file():  # an image,caption .csv
        return {"kind": "stat", "digest": digest([[Path(source).name, Path(source).stat().st_size,
                                                   str(Path(source).stat().st_mtime_ns)]])}
    return {"kind": "etag" if storage.is_s3(source) else "stat", "digest": digest(storage.tree_entries(source))}


def _class_list(name: str | None) -> dict[str, str] | None:
    if name is None:
        return None
    text = packaged_class_set(name) if name in packaged_class_sets() else storage.read_bytes(name).decode("utf-8")
    return {"name": name, "digest": hashlib.sha256(text.encode()).hexdigest()}


def dataset_fingerprint(entry: DatasetConfig) -> dict[str, Any]:
    return {"source": entry.source, "content": source_content(entry.source), "tasks": sorted(entry.tasks),
            "splits": entry.splits.model_dump(), "classnames": _class_list(entry.classnames),
            "label_key": entry.label_key, "few_shot": entry.few_shot}
