"""Embeddings of an image set (and its captions or class prompts), computed once and cached on disk.

The cache key covers the weights (their hash), the data set's identity, the preprocessing, what is embedded and,
where it is not fp32, the precision, so a retrained model or other data never reuses stale features. Cache files
are plain tensors and lists, read with ``weights_only=True``.

Image features are computed as the images stream in: the batches the data loader's workers decode are embedded
(on a GPU, the next batch is sent before the last one's features are fetched) and each batch's features go to a
spool file at once. Memory holds the images in flight and, at the end, the ``N x d`` features the tasks need
(retrieval, the probe and zero-shot all score every image against the others or against classes); the encoded
images are not held (docs/evaluation.md, "Memory"), unless a caller that embeds the same sets with many models
keeps them, within a budget (``Encoding.kept``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from cloob_core.config import ConfigError
from cloob_core.data.shard_files import SkipCounter
from cloob_core.devices import AUTOCAST_DTYPES
from cloob_core.evaluation.image_loader import Batch, Unreadable, check_labels, image_batches
from cloob_core.evaluation.inputs import ImageSet, Indexed, Record
from cloob_core.evaluation.kept import KeptInputs
from cloob_core.io import UnreadableFile, naming_full_disk, read_torch, write_torch
from cloob_core.memory_limit import naming_killed_workers
from cloob_core.model.source import EvalModel
from cloob_core.threads import CoreBalance, plan_eval_threads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Encoding:
    """How features are computed: the cache folder (None: none), images per batch, progress bars, a folder of
    features computed ahead that is only read (a Kubeflow step's input artifact, shared by a data set's tasks),
    the data-loader workers (None: as the thread budget gives, :func:`cloob_core.threads.plan_eval_threads`), and
    where decoded images and tokens are kept for the next model (None: made each time)."""

    cache: Path | None = None
    batch_size: int = 256
    progress: bool = True
    shared: Path | None = None
    workers: int | None = None
    kept: KeptInputs | None = None


@dataclass
class Embedded:
    """An image set's readable images, embedded, in the set's order, with what each sample carried."""

    features: Tensor  # [N, d] float32, unit norm
    labels: list[int] | None  # None: some sample had no label
    captions: list[list[str]] | None  # None: no sample had a caption; [] for a sample without one
    classnames: dict[int, str]  # label -> name, as a stream's samples named them
    skipped: int  # samples or shards that did not read
    precision: str  # what the features were computed at (features computed ahead may differ from the model's)

    def as_saved(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _SAVED_FIELDS}


# a cache entry's keys, in the dataclass's order: a set's order changes with each process's hash seed, and with it
# the saved bytes of the same contents
_SAVED_FIELDS = tuple(field.name for field in dataclasses.fields(Embedded))


def _read_cached(path: Path) -> Any:
    if not path.exists():
        return None
    try:
        cached = read_torch(path, str(path))
    except UnreadableFile as err:  # a damaged cache entry is computed again, not fatal
        log.warning("%s; computing it again", err)
        return None
    log.debug("features from cache %s", path)
    return cached


def _file_name(key: str) -> str:
    return f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"


def _cached(encoding: Encoding, key: str, compute, valid=lambda value: isinstance(value, Tensor),
            shared_keys: Sequence[str] = ()) -> Any:
    """The value of ``key``: from the shared folder (under ``key`` or one of ``shared_keys``), the cache, or
    computed and cached."""
    name = _file_name(key)
    places = [] if encoding.shared is None else [encoding.shared / _file_name(k) for k in (key, *shared_keys)]
    places += [] if encoding.cache is None else [encoding.cache / name]
    for place in places:
        found = _read_cached(place)
        if found is not None and valid(found):
            return found
    value = compute()
    if encoding.cache is not None:
        write_torch(encoding.cache / name, value)
    return value


def _precision_key(precision: str) -> str:
    return "" if precision == "fp32" else f"|{precision}"  # fp32's keys are those from before


class _Spool:
    """Features written to an unnamed file as they are computed, with each row's key; :meth:`read` puts them in
    key order into one tensor, a block at a time."""

    BLOCK = 8192  # rows per read

    def __init__(self, file: IO[bytes]):
        self.file = file
        self.keys: list[Tensor] = []
        self.records: list[Record] = []
        self.width = 0

    def add(self, features: Tensor, keys: Tensor, records: list[Record]) -> None:
        rows = features.float().numpy()
        self.width = rows.shape[1]
        self.file.write(rows.tobytes())
        self.keys.append(keys)
        self.records += records

    def read(self) -> tuple[Tensor, list[Record]]:
        keys = torch.cat(self.keys) if self.keys else torch.zeros(0, dtype=torch.int64)
        order = torch.argsort(keys, stable=True)  # order[i]: the spool row that goes to position i
        in_order = bool((order == torch.arange(len(order))).all())
        if not in_order:
            rank = torch.empty_like(order)
            rank[order] = torch.arange(len(order))  # rank[j]: the position of spool row j
        out = torch.empty(len(keys), self.width)
        self.file.seek(0)
        for start in range(0, len(keys), self.BLOCK):
            block = np.frombuffer(self.file.read(self.BLOCK * self.width * 4), dtype=np.float32)
            rows = torch.from_numpy(block.reshape(-1, self.width).copy())
            if in_order:
                out[start : start + len(rows)] = rows
            else:
                out[rank[start : start + len(rows)]] = rows
        return out, self.records if in_order else [self.records[i] for i in order.tolist()]


def image_features(model: EvalModel, images: ImageSet, encoding: Encoding) -> Embedded:
    """``images`` embedded by ``model``: from the cache, or computed (and cached)."""
    def compute() -> dict[str, Any]:
        return _embed(model, images, encoding).as_saved()

    key = f"images|{model.fingerprint}|{images.identity}|{model.transform}"
    # features computed ahead (a Kubeflow features step, on a GPU) serve the task steps (on CPU pods) at whatever
    # precision they were computed
    others = [key + _precision_key(p) for p in AUTOCAST_DTYPES if p != model.precision]
    saved = _cached(encoding, key + _precision_key(model.precision), compute, shared_keys=others,
                    valid=lambda value: isinstance(value, dict) and set(value) == set(_SAVED_FIELDS)
                    and isinstance(value["features"], Tensor))
    embedded = Embedded(**saved)
    if embedded.skipped:
        log.warning("%s: %d unreadable sample(s) or shard(s) skipped", images.name, embedded.skipped)
    return embedded


def _embed(model: EvalModel, images: ImageSet, encoding: Encoding) -> Embedded:
    budget = plan_eval_threads(model.device.type, encoding.workers).apply()
    balance = CoreBalance(budget.cores, budget.torch_threads) if model.device.type == "cpu" and budget.workers else None
    skips = SkipCounter()
    if encoding.cache is not None:  # the spool beside the cache (a pod's /tmp may be memory)
        encoding.cache.mkdir(parents=True, exist_ok=True)
    folder = encoding.cache if encoding.cache is not None else Path(tempfile.gettempdir())
    with (naming_full_disk(f"{folder}/ (the features spool, an unnamed file; --cache DIR puts it elsewhere)"),
          tempfile.TemporaryFile(dir=folder, prefix=".features-") as file,
          naming_killed_workers(lambda killed: f"{images.name}: {killed}: lower --workers (here {budget.workers}) "
                                f"or --batch-size (here {encoding.batch_size})")):
        features, records = _embed_into(_Spool(file), model, images, encoding, budget.workers, skips, balance)
    if not len(records):
        raise ConfigError(f"{images.name}: no readable image ({skips.skipped} unreadable sample(s) or shard(s))")
    labels = [r.label for r in records]
    captions = [[caption for caption in r.captions if caption.strip()] for r in records]  # a blank one is none
    return Embedded(features, labels if None not in labels else None, captions if any(captions) else None,
                    {r.label: r.classname for r in records if r.classname is not None and r.label is not None},
                    skips.skipped, model.precision)


def _embed_into(spool: _Spool, model: EvalModel, images: ImageSet, encoding: Encoding, workers: int,
                skips: SkipCounter, balance: CoreBalance | None) -> tuple[Tensor, list[Record]]:
    device = model.device
    total = images.reader.size if isinstance(images.reader, Indexed) else None
    bar = tqdm(total=total, desc=f"embed {images.name}", unit="img", disable=not encoding.progress)
    batches = image_batches(images, model.transform, batch_size=encoding.batch_size, workers=workers,
                            pin_memory=device.type == "cuda", kept=encoding.kept)
    with contextlib.closing(batches):  # whatever ends the loop, the data-loader workers are stopped
        pending = _embed_batches(spool, model, images, batches, skips, balance, bar)
    if pending is not None:
        spool.add(pending[0].cpu(), pending[1].keys, pending[1].records)
    bar.close()
    return spool.read()


def _embed_batches(spool: _Spool, model: EvalModel, images: ImageSet, batches: Iterator[Batch], skips: SkipCounter,
                   balance: CoreBalance | None, bar: tqdm) -> tuple[Tensor, Batch] | None:
    """Each batch embedded, the one before it spooled; the last batch's features are returned, not spooled."""
    pending: tuple[Tensor, Batch] | None = None  # a GPU batch whose features are not fetched yet
    while True:
        started = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            return pending
        arrived = time.perf_counter()
        for why, lost in batch.unreadable:
            skips(Unreadable(why), lost)
        check_labels(images, batch)
        if len(batch.keys):
            features = model.encode_images(batch.images)
            if pending is not None:
                spool.add(pending[0].cpu(), pending[1].keys, pending[1].records)
            pending = (features, batch)
        if balance is not None:
            balance.record(arrived - started, time.perf_counter() - arrived)
        bar.update(len(batch.keys) + sum(lost for _, lost in batch.unreadable))


def text_features(model: EvalModel, texts: Sequence[str], encoding: Encoding, tag: str) -> Tensor:
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    step = 2 * encoding.batch_size  # texts are cheaper to encode than images
    tokenizer = f"{model.architecture}|{type(model.tokenizer).__name__}"

    def tokens(start: int) -> Tensor:
        def tokenize() -> Tensor:
            return model.tokenizer(list(texts[start : start + step]))

        kept = encoding.kept
        return tokenize() if kept is None else kept.tokens((tokenizer, f"{digest}|{start}|{step}"), tokenize)

    def compute() -> Tensor:
        return torch.cat([model.encode_texts(tokens(start)).cpu() for start in range(0, len(texts), step)])

    return _cached(encoding, f"texts|{model.fingerprint}|{tag}|{digest}{_precision_key(model.precision)}", compute)
