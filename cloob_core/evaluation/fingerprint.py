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


def _s3_listing(location: str) -> list[list[Any]]:
    bucket, prefix = storage.split_s3(location)
    prefix = prefix.rstrip("/")
    listed = []
    for page in storage.s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        listed += [[item["Key"][len(prefix):], item["Size"], item["ETag"]] for item in page.get("Contents", [])
                   if item["Key"] == prefix or item["Key"].startswith(prefix + "/")]
    return sorted(listed)


def _local_listing(location: str) -> list[list[Any]]:
    root = Path(location)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [[p.relative_to(root).as_posix() if p != root else p.name, p.stat().st_size, p.stat().st_mtime_ns]
            for p in files]


def source_content(source: str) -> dict[str, str]:
    """The digest of a source's content where it can be known without reading it, and how it was taken."""
    if source in PACKAGED_SOURCES:
        return {"kind": "arrays", "digest": _packaged(source)}
    if storage.is_s3(source):
        return {"kind": "etag", "digest": digest(_s3_listing(source))}
    return {"kind": "stat", "digest": digest(_local_listing(source))}


def _class_list(name: str | None) -> dict[str, str] | None:
    if name is None:
        return None
    text = packaged_class_set(name) if name in packaged_class_sets() else storage.read_bytes(name).decode("utf-8")
    return {"name": name, "digest": hashlib.sha256(text.encode()).hexdigest()}


def dataset_fingerprint(entry: DatasetConfig) -> dict[str, Any]:
    return {"source": entry.source, "content": source_content(entry.source), "tasks": sorted(entry.tasks),
            "splits": entry.splits.model_dump(), "classnames": _class_list(entry.classnames),
            "label_key": entry.label_key, "few_shot": entry.few_shot}
