"""Reading shards for training: a WebDataset pipeline over local or ``s3://`` shards.

Shards are split by node (rank) and by data-loader worker, samples shuffled through a buffer, and a corrupt
sample or tar is skipped with a counted warning instead of ending the run. With ``resampled=True`` shards are
drawn with replacement and an epoch is a fixed number of samples ("virtual epochs", as open_clip does for
data sets that do not divide evenly over ranks and workers).
"""

from __future__ import annotations

import json
import logging
import random
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import webdataset as wds

from cloob_core import storage

log = logging.getLogger(__name__)
_BRACES = re.compile(r"\{\d+\.\.\d+\}")


def _gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192, **_: Any) -> Any:
    if mode not in ("rb", "r"):
        raise ValueError(f"{url}: s3 shards open for reading only")
    return storage.open_read(url)


def register_s3() -> None:
    """Let webdataset open ``s3://`` shards through boto3 (it has no handler of its own)."""
    sys.modules["webdataset.gopen"].gopen_schemes["s3"] = _gopen_s3  # the package re-exports a function of that name


@dataclass
class SkipCounter:
    """A webdataset handler that skips what cannot be read, counting and logging it (first few in full)."""

    log_first: int = 5
    skipped: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, exn: Exception) -> bool:
        with self._lock:
            self.skipped += 1
            name = type(exn).__name__
            self.reasons[name] = self.reasons.get(name, 0) + 1
            if self.skipped <= self.log_first:
                log.warning("skipping unreadable data (%s: %s)", name, str(exn)[:300])
            elif self.skipped in (self.log_first + 1, 100, 1000, 10000):
                log.warning("skipped %d unreadable samples or shards so far", self.skipped)
        return True


def shard_list(location: str | list[str]) -> tuple[list[str], int | None]:
    """Shard URLs and the sample count: a folder with ``sizes.json``, a brace pattern, or a list of URLs."""
    if isinstance(location, list):
        return location, None
    if _BRACES.search(location) or location.endswith(".tar"):
        import braceexpand

        return list(braceexpand.braceexpand(location)), None
    try:
        sizes = json.loads(storage.read_bytes(storage.join(location, "sizes.json")))
    except FileNotFoundError:
        names = storage.list_names(location, ".tar")
        if not names:
            raise FileNotFoundError(f"no sizes.json and no .tar shards in {location}") from None
        return [storage.join(location, name) for name in names], None
    return [storage.join(location, name) for name in sorted(sizes)], int(sum(sizes.values()))


def make_dataset(
    shards: str | list[str],
    image_transform: Callable[[Any], Any],
    tokenize: Callable[[str], Any],
    *,
    shuffle_buffer: int = 1000,
    seed: int = 0,
    resampled: bool = False,
    epoch: int = 0,
    epoch_samples: int | None = None,
    extra_keys: tuple[str, ...] = (),
    skip_counter: SkipCounter | None = None,
) -> wds.DataPipeline:
    """Samples as ``(image, tokens, *extra)``; ``extra_keys`` picks fields of the sample's json (e.g. label).

    ``seed`` and ``epoch`` fix the shard order and the sample shuffle, so a run is reproducible.
    """
    register_s3()
    urls, _ = shard_list(shards)
    handler = skip_counter or SkipCounter()
    stages: list[Any] = []
    if resampled:
        stages.append(wds.ResampledShards(urls, seed=seed, deterministic=True))  # seeds include rank and worker
    else:
        stages.append(wds.SimpleShardList(urls))
        if shuffle_buffer > 1:  # the same shard order on every rank, a new one each epoch, then split
            stages.append(wds.detshuffle(bufsize=len(urls), initial=len(urls), seed=seed, epoch=epoch - 1))
        stages += [wds.split_by_node, wds.split_by_worker]
    stages.append(wds.tarfile_to_samples(handler=handler))
    if shuffle_buffer > 1:
        stages.append(SampleShuffle(shuffle_buffer, seed, epoch))
    stages += [
        wds.decode("pilrgb", handler=handler),
        wds.to_tuple("jpg;png;jpeg;webp", "txt", "json", handler=handler),
        wds.map(_finish(image_transform, tokenize, extra_keys), handler=handler),
    ]
    pipeline = wds.DataPipeline(*stages)
    if epoch_samples is not None:
        pipeline = pipeline.with_epoch(epoch_samples)
    return pipeline


class SampleShuffle(wds.PipelineStage):
    """Buffer shuffle seeded by (seed, epoch, rank and worker): reproducible, different in every data-loader
    worker and every epoch (each pass over the pipeline is the next epoch)."""

    def __init__(self, bufsize: int, seed: int, epoch: int = 0):
        self.bufsize, self.seed, self.epoch = bufsize, seed, epoch

    def run(self, src: Any) -> Any:
        rng = random.Random(wds.utils.make_seed(self.seed, self.epoch, wds.utils.pytorch_worker_seed()))
        self.epoch += 1
        return wds.filters._shuffle(src, self.bufsize, min(self.bufsize, 100), rng)


def _finish(image_transform: Callable, tokenize: Callable, extra_keys: tuple[str, ...]) -> Callable:
    def finish(sample: tuple) -> tuple:
        image, caption, meta = sample
        if isinstance(caption, bytes):
            caption = caption.decode("utf-8")
        tokens = tokenize(caption)
        if getattr(tokens, "ndim", 1) == 2:
            tokens = tokens[0]
        extras = tuple(meta[key] for key in extra_keys)
        return (image_transform(image), tokens, *extras)

    return finish
