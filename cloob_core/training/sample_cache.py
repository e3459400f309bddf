"""Decoded training samples kept in a data-loader worker for the next passes over a small data set.

A laptop run passes over its shards dozens of times (the default set: 2,047 pairs, 40 passes), and each pass
used to read every tar, decode every JPEG and tokenise every caption again: about 0.56 ms of a worker's core per
sample, a third of the training step's own cost, taken from the cores the step runs on. A shard read whole, with
no unreadable member, is kept here as its list of samples, each with its decoded image and its caption's tokens
once they have been made; the next pass replays that list instead of the tar. The crop is still drawn per pass.

The stream is the same with or without the cache: the same samples in the same order (the shuffle buffer sees
the same sequence), the same decoding failures counted once per pass, the same tokens. Only the time differs.

Memory: up to ``budget`` bytes per worker (``train.sample_cache_mb``), counted as the decoded pixels, the tokens
and the sample's other fields. A shard is kept only if the cache was under budget when its read began, so the
cache ends at most one shard over it. Past the budget, shards stream from storage as before: a crawl far larger
than the budget keeps the first shards each worker reads and no more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import webdataset as wds
from PIL import Image

from cloob_core.data.shard_files import SkipCounter

IMAGE = "__image__"  # the decoded image, or the exception its decoding raised
TOKENS = "__tokens__"  # the caption's token row (one text view)
KEPT = "__kept__"  # the sample belongs to a shard in the cache: what is added to it counts against the budget


class SampleCache:
    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0
        self._shards: dict[str, list[dict[str, Any]]] = {}

    def read(self, urls: list[str], handler: SkipCounter) -> Iterator[dict[str, Any]]:
        """The samples of ``urls`` in order: kept shards from memory, the others from their tars."""
        for url in urls:
            if url in self._shards:
                yield from self._shards[url]
            else:
                yield from self._read_tar(url, handler)

    def _read_tar(self, url: str, handler: SkipCounter) -> Iterator[dict[str, Any]]:
        keep, unreadable, fresh = self.used < self.budget, [], []

        def counted(err: Exception) -> bool:
            unreadable.append(err)
            return handler(err)

        for sample in wds.tarfile_to_samples(handler=counted)(iter([{"url": url}])):
            if keep:
                fresh.append(sample)
            yield sample
        if keep and not unreadable:  # a shard with unreadable members is read again each pass
            for sample in fresh:
                sample[KEPT] = True
                self.used += _size(sample)
            self._shards[url] = fresh

    def image(self, sample: dict[str, Any], keys: tuple[str, ...], decode: Callable[[bytes], Image.Image]
              ) -> Image.Image:
        """The sample's decoded image (its first of ``keys``), decoded once; a failure is raised every time."""
        if IMAGE not in sample:
            before = _size(sample)
            try:
                sample[IMAGE] = decode(_first(sample, keys))
            except Exception as err:  # kept, and raised below on every pass, for the caller to count
                sample[IMAGE] = err
            for key in keys:
                sample.pop(key, None)
            self._charge(sample, before)
        if isinstance(sample[IMAGE], Exception):
            raise sample[IMAGE].with_traceback(None)  # not a traceback that grows with every pass
        return sample[IMAGE]

    def keep_tokens(self, sample: dict[str, Any], tokens: Any) -> None:
        before = _size(sample)
        sample[TOKENS] = tokens
        self._charge(sample, before)

    def _charge(self, sample: dict[str, Any], before: int) -> None:
        if sample.get(KEPT):
            self.used += _size(sample) - before


def _first(sample: dict[str, Any], keys: tuple[str, ...]) -> bytes:
    for key in keys:
        if key in sample:
            return sample[key]
    raise KeyError(f"sample {sample.get('__key__')} has none of {keys}")


def _size(sample: dict[str, Any]) -> int:
    total = 0
    for value in sample.values():
        if isinstance(value, bytes | str):
            total += len(value)
        elif isinstance(value, Image.Image):
            total += value.width * value.height * len(value.getbands())
        elif hasattr(value, "nbytes"):
            total += int(value.nbytes)
    return total
