"""An image set's images, decoded and transformed in data-loader workers and delivered in batches: the one way
evaluation reads images.

Each sample is decoded once, in a worker. One that does not decode, or a shard that does not read, is left out and
reported to the main process, which counts it once (:class:`cloob_core.data.shard_files.SkipCounter`, as training
does). A batch carries each sample's key, its position in the set's order (a shard's samples: shard index and
position in it), so that features land in that order whatever the number of workers: a stream's shards are dealt to
the workers in turn, and their batches arrive interleaved. On a GPU the batches are page-locked for an
asynchronous copy.

A caller that needs more of a stream's samples than pixels and a record (curation's scoring: hashes, sizes, the
caption's language and tokens) gives a ``describe`` that computes it in the worker, beside the decode, and may ask
for each shard's end to be marked in the batches, so that it can write a shard's results as soon as they are all in.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from PIL import Image
from torch import Tensor

from cloob_core import storage
from cloob_core.errors import StageError
from cloob_core.evaluation.inputs import ImageSet, Indexed, Record, ShardStream
from cloob_core.evaluation.kept import KeptInputs

log = logging.getLogger(__name__)
SHARD_STRIDE = 1 << 32  # a stream sample's key: shard index * SHARD_STRIDE + its position in the shard


class LabelError(StageError, ValueError):
    """A sample labelled with no class of its set."""


class Unreadable(Exception):
    """A sample or shard a worker could not read; its message says why."""


# What ``describe`` computes for a readable sample of a stream, in the worker: (the sample's fields as webdataset
# read them, the image's bytes, the decoded image) -> facts carried to the main process in the batch
Describe = Callable[[dict[str, Any], bytes, Image.Image], Any]


@dataclass
class Batch:
    images: Tensor  # [B, 3, H, W]: the readable samples only
    keys: Tensor  # [B] int64: each sample's position in the set's order
    records: list[Record]
    unreadable: list[tuple[str, int]]  # why each sample or tar left out since the previous batch did not read, and
    # the samples it lost
    facts: list[Any] | None = None  # describe's result for each readable sample, where a describe was given
    ended: list[int] | None = None  # shards a worker finished reading (with mark_ends): all of their samples a
    # worker reads are in this batch or an earlier one
    failed: list[tuple[int, str]] | None = None  # shards storage did not give whole (with mark_ends), and why: their
    # samples in this batch or earlier ones are not the shard's

    def pin_memory(self) -> Batch:  # called by the DataLoader's pinning thread when it pins
        self.images = self.images.pin_memory()
        return self


class _Ended(NamedTuple):
    """A worker's mark that it finished reading a shard (its share of it, where workers share a shard)."""

    shard: int


class _Failed(NamedTuple):
    """A worker's mark that storage did not give a shard's bytes (:func:`storage.is_read_fault`): the shard is
    not read, as opposed to a shard whose samples are broken."""

    shard: int
    why: str


# (pixels, key, record, facts), or (None, samples lost, why they did not read, None), or (None, 0, _Ended or
# _Failed, None)
_Item = tuple[Tensor | None, int, Record | str | _Ended | _Failed, Any]


class _IndexedImages(torch.utils.data.Dataset):
    def __init__(self, reader: Indexed, transform: Callable[[Image.Image], Tensor]):
        self.reader, self.transform = reader, transform

    def __len__(self) -> int:
        return self.reader.size

    def __getitem__(self, index: int) -> _Item:
        try:
            pixels = self.transform(self.reader.open(index))
        except Exception as err:  # whatever a broken image raises, in a worker: reported as data
            return None, 1, f"image {index}: {type(err).__name__}: {err}", None
        return pixels, index, self.reader.record(index), None


class _StreamedImages(torch.utils.data.IterableDataset):
    """The stream's shards, read front to back by webdataset's tar reader with a handler that turns what does not
    read into an item saying so. With at least as many shards as workers, shard i goes to worker i mod W; with
    fewer (a set of one 10,000-image tar), every worker reads every shard and decodes the samples at positions
    congruent to its number mod W: reading a tar costs little beside decoding its images."""

    def __init__(self, reader: ShardStream, transform: Callable[[Image.Image], Tensor],
                 describe: Describe | None = None, mark_ends: bool = False):
        self.reader, self.transform, self.describe, self.mark_ends = reader, transform, describe, mark_ends

    def __iter__(self) -> Iterator[_Item]:
        import webdataset  # noqa: F401  (register_s3 adds to its URL openers)

        from cloob_core.data.shard_files import register_s3

        register_s3()
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        by_shard = readers_per_shard(len(self.reader.urls), workers) == 1
        for shard in range(worker, len(self.reader.urls), workers) if by_shard else range(len(self.reader.urls)):
            yield from self._shard(shard, None if by_shard else (worker, workers))
            if self.mark_ends:
                yield None, 0, _Ended(shard), None

    def _shard(self, shard: int, share: tuple[int, int] | None) -> Iterator[_Item]:
        """The samples of one tar (with ``share`` (worker, workers): those at the worker's positions). A tar that
        breaks (cut short, corrupt, or ending before the samples its set records) is one item counting the
        samples it lost, reported by one worker: the sample the break cut is one of them, not an unreadable sample
        of its own. A tar that storage did not give (a read fault after the tries) is not a broken tar: with
        ``mark_ends`` it is marked failed, for the caller to read again later; otherwise the fault is raised."""
        import io

        import webdataset as wds

        url = self.reader.urls[shard]
        errors: list[Exception] = []  # webdataset reports one break at each of its layers: the first says why

        def handler(err: Exception) -> bool:
            errors.append(err)
            return True

        read, held, last = 0, None, None  # held: the last sample's failure, kept until it is known not to be a cut
        for position, raw in enumerate(wds.tarfile_samples([{"url": url}], handler=handler)):
            if held is not None:
                yield held
                held = None
            read, last = position + 1, raw
            if share is not None and position % share[1] != share[0]:
                continue
            try:
                image, record = self.reader.parse(raw)
                decoded = Image.open(io.BytesIO(image)).convert("RGB")
                pixels = self.transform(decoded)
                facts = None if self.describe is None else self.describe(raw, image, decoded)
            except Exception as err:  # whatever a broken member raises
                held = (None, 1, f"{url} sample {raw.get('__key__')!r}: {type(err).__name__}: {str(err)[:300]}",
                        None)
                continue
            yield pixels, shard * SHARD_STRIDE + position, record, facts
        if errors and storage.is_read_fault(errors[0]):
            if not self.mark_ends:
                raise errors[0]
            first = errors[0].args[0] if errors[0].args else errors[0]  # webdataset adds " @ <the stream>", and
            said = str(first).split(" @ ")[0].splitlines()  # the URL as an argument of its own
            yield None, 0, _Failed(shard, f"{type(errors[0]).__name__}: {said[0][:200]}" if said
                                   else type(errors[0]).__name__), None
            return
        size = None if self.reader.sizes is None else self.reader.sizes[shard]
        broke = bool(errors) or (size is not None and read < size)
        cut = broke and last is not None and not self._parses(last)
        if cut:  # the last sample is the one the break cut short: part of the tar's loss
            read, held = read - 1, None
        if held is not None:
            yield held
        if broke and (share is None or share[0] == 0):
            yield self._loss(url, read, size, cut, errors[0] if errors else None)

    def _parses(self, raw: dict[str, Any]) -> bool:
        try:
            self.reader.parse(raw)
        except Exception:  # whatever a sample missing its members raises
            return False
        return True

    @staticmethod
    def _loss(url: str, read: int, size: int | None, cut: bool, error: Exception | None) -> _Item:
        """The item saying what a broken tar lost: its samples past the ``read`` it gave whole (where its set
        records its size; else the one it cut, or at least one)."""
        why = "it ends early" if error is None else f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        if size is not None:
            return (None, size - read, f"{url}: {size - read} of its {size} samples lost after sample {read} ({why})",
                    None)
        lost = "the sample it cut and any after it" if cut else "any samples after them"
        return None, 1, f"{url}: broken after {read} samples ({why}); {lost} lost (no sizes.json counts them)", None


def readers_per_shard(shards: int, workers: int) -> int:
    """How many workers read each shard of a stream (each its share of the samples): one where there are at least
    as many shards as workers (0 workers: this process, one reader), else every worker."""
    return 1 if shards >= max(workers, 1) else workers


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def _collate(items: list[_Item]) -> Batch:
    """A batch of the items, in the worker that read them; then the heap's free pages go back to the system
    (glibc's ``malloc_trim``). Without it a worker grew by about 7 KiB per image read (205 to 305 MB over 40,000
    photos): glibc raises its mmap threshold to the size of each large block freed, so a decoded image's buffers
    (a few hundred KiB) come from the heap after the first, and the heap fragments. Trimming once a batch kept
    workers flat (191-208 MB) and cost nothing measurable; keeping the threshold at 128 KiB did too, but cost 20% of
    the decoding time in page faults."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
    readable = [item for item in items if item[0] is not None]
    images = torch.stack([item[0] for item in readable]) if readable else torch.empty(0)
    ended = [item[2].shard for item in items if isinstance(item[2], _Ended)]
    failed = [(item[2].shard, item[2].why) for item in items if isinstance(item[2], _Failed)]
    described = any(item[3] is not None for item in readable)
    return Batch(images, torch.tensor([item[1] for item in readable], dtype=torch.int64),
                 [item[2] for item in readable],
                 [(item[2], item[1]) for item in items if item[0] is None and isinstance(item[2], str)],
                 [item[3] for item in readable] if described else None, ended or None, failed or None)


def image_batches(images: ImageSet, transform: Callable[[Image.Image], Tensor], *, batch_size: int, workers: int,
                  pin_memory: bool = False, kept: KeptInputs | None = None, describe: Describe | None = None,
                  mark_ends: bool = False) -> Iterator[Batch]:
    """``images`` in batches of up to ``batch_size`` readable samples (a stream's last batch of each worker may be
    short), read by ``workers`` processes (0: in this one), or from ``kept`` when it holds them. A stream's
    samples may be described (``describe``) and its shards' ends marked (``mark_ends``), see the module."""
    if (describe is not None or mark_ends) and (kept is not None or not isinstance(images.reader, ShardStream)):
        raise ValueError("describe and mark_ends are for a stream of shards read afresh")
    if kept is not None:
        yield from kept.batches((images.identity, str(transform)), lambda: image_batches(
            images, transform, batch_size=batch_size, workers=workers, pin_memory=pin_memory))
        return
    reader = images.reader
    if isinstance(reader, ShardStream):
        dataset: torch.utils.data.Dataset = _StreamedImages(reader, transform, describe, mark_ends)
    else:
        dataset = _IndexedImages(reader, transform)
    options: dict[str, Any] = {"num_workers": workers, "batch_size": batch_size, "collate_fn": _collate,
                               "pin_memory": pin_memory}
    if workers:
        options.update(prefetch_factor=2, persistent_workers=False)
    loading = iter(torch.utils.data.DataLoader(dataset, **options))
    try:
        yield from loading
    finally:  # the caller stopped early (an error, a refusal): the workers are stopped now, not at collection
        shutdown = getattr(loading, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def sample_name(reader: Indexed | ShardStream, key: int) -> str:
    """The sample at position ``key`` of a batch, as a user finds it: a shard's URL and the sample's place in it,
    or an indexed set's image number."""
    if isinstance(reader, ShardStream):
        shard, position = divmod(key, SHARD_STRIDE)
        return f"{reader.urls[shard]} sample {position}"
    return f"image {key}"


def check_labels(images: ImageSet, batch: Batch) -> None:
    """A batch's labels are classes of ``images``: none negative (Python's indexing would score -1 as the last
    class), none past the set's class names where it names them. Refused naming the first sample that is not."""
    classes = len(images.classnames) if images.classnames is not None else None
    for key, record in zip(batch.keys.tolist(), batch.records, strict=True):
        label = record.label
        if label is not None and (label < 0 or (classes is not None and label >= classes)):
            bound = f"the {classes} classes 0-{classes - 1}" if classes is not None else "the classes 0, 1, ..."
            raise LabelError(f"{images.name}: {sample_name(images.reader, key)} has label {label}, outside "
                             f"{bound}; give every sample a class of the set (or leave the sample out)")
