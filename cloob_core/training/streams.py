"""The training data order: ``data_streams`` independent shard streams, each contributing an equal chunk to
every batch.

Stream ``v`` reads shards ``v, v+V, v+2V, …`` over and over (pass ``p`` in an order seeded by (seed, p, v),
through a shuffle buffer seeded the same way). Batch ``i`` is the concatenation, in stream order, of chunk ``i``
of every stream; rank ``r`` of ``W`` owns the contiguous streams ``[r·V/W, (r+1)·V/W)``, so the global batch is
the same whatever the number of ranks, and ranks never wait for one another at an epoch's end.

A stream's position is (pass, samples taken from the pass's shuffled order). That pair is all a checkpoint
needs: on resume the stream replays the pass's tar headers and shuffle without decoding a single image, and
continues with exactly the sample that came next. Augmentation is seeded per (seed, step, stream), so it
resumes too. Workers write uint8 crops and token rows straight into the step's slot of a shared
:class:`~cloob_core.training.batch_ring.BatchRing`; the loop normalises each batch on its device.

Unreadable samples are skipped and counted, but a stream that reads a whole pass without one decodable sample
stops training: otherwise it would skip forever. The failure travels as a chunk to the main process, which
raises it, so a data-loader worker never turns it into a traceback.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch
import webdataset as wds

from cloob_core.config import TrainConfig
from cloob_core.data.shard_files import IMAGE_KEYS, SkipCounter, register_s3
from cloob_core.errors import StageError
from cloob_core.training.batch_ring import BatchRing
from cloob_core.training.images import TrainImages
from cloob_core.training.sample_cache import TOKENS, SampleCache
from cloob_core.training.worker_gate import WorkerGate

log = logging.getLogger(__name__)
Position = tuple[int, int]  # (pass, samples of that pass consumed)


class UnreadableData(StageError):
    """A data stream holds nothing that decodes: skipping would never end."""


def carry_positions(positions: dict[int, Position], saved_streams: int, streams: int,
                    where: str = "the checkpoint") -> dict[int, Position]:
    """The positions a resumed run's streams start at. With the checkpoint's number of streams (on any number of
    ranks that divides it) each stream continues exactly where it stood. With another number, the streams read
    other shards, so no position carries over: every stream starts a new pass, numbered after the furthest pass
    any saved stream reached (a fresh shuffle, not a replay of the first); the rest of the interrupted pass is
    not seen, and the data order is exact again from there on."""
    if streams == saved_streams:
        return dict(positions)
    next_pass = max((p for p, _ in positions.values()), default=-1) + 1
    log.warning("%s was written with %d data streams, this run has %d: each stream starts pass %d afresh (the rest "
                "of the interrupted pass is skipped; docs/training.md, \"Resuming elsewhere\")", where,
                saved_streams, streams, next_pass)
    return {v: (next_pass, 0) for v in range(streams)}


def stream_shards(urls: list[str], streams: int) -> list[list[str]]:
    if len(urls) < streams:
        raise ValueError(
            f"{len(urls)} shard(s) cannot feed {streams} data streams; write smaller shards "
            f"(preprocess.shard_size) or lower train.data_streams"
        )
    return [urls[v::streams] for v in range(streams)]


@dataclass(frozen=True)
class Mix:
    """The data streams of a run of several sources: each stream reads one source's shards, and a source has data
    streams in proportion to its weight, so each batch takes that share of its samples from it. ``shares``: each
    source's realised share of every batch (its streams over all streams)."""

    per_stream: list[list[str]]
    shares: dict[str, float]


def mixed_streams(sources: list[tuple[str, list[str], float]], streams: int) -> Mix:
    """``streams`` data streams over ``sources`` (name, shard URLs, weight): the largest-remainder apportionment
    of the streams to the weights, at least one each; each source's shards split over its own streams."""
    if len(sources) > streams:
        raise ValueError(f"{len(sources)} train.sources need at least as many data streams, not {streams}: raise "
                         "train.data_streams")
    total = sum(weight for _, _, weight in sources)
    exact = [weight / total * streams for _, _, weight in sources]
    counts = [max(1, math.floor(e)) for e in exact]
    while sum(counts) < streams:  # the largest remainders get the streams left
        counts[max(range(len(counts)), key=lambda i: exact[i] - counts[i])] += 1
    while sum(counts) > streams:  # a source raised to one stream takes it from the most over-served
        counts[max((i for i in range(len(counts)) if counts[i] > 1), key=lambda i: counts[i] - exact[i])] -= 1
    per_stream: list[list[str]] = []
    for (name, urls, _), given in zip(sources, counts, strict=True):
        try:
            per_stream += stream_shards(urls, given)
        except ValueError as err:
            raise ValueError(f"train.sources {name}: {err}") from None
    return Mix(per_stream, {name: given / streams for (name, _, _), given in zip(sources, counts, strict=True)})


def rank_streams(streams: int, rank: int, world_size: int) -> list[int]:
    """The streams of ``rank``: an equal share (``TrainConfig.check_shape`` made sure there is one)."""
    per_rank = streams // world_size
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def raw_stream(urls: list[str], stream: int, seed: int, shuffle_buffer: int, start: Position,
               handler: SkipCounter, cache: SampleCache) -> Iterator[tuple[Position, dict[str, Any]]]:
    """Samples of one stream, forever, each with the stream position after it (undecoded, unless ``cache``
    kept them decoded from an earlier pass)."""
    register_s3()
    first_pass, skip = start
    for pass_ in count(first_pass):
        order = list(urls)
        random.Random(wds.utils.make_seed(seed, pass_, stream)).shuffle(order)
        samples = cache.read(order, handler)
        if shuffle_buffer > 1:
            rng = random.Random(wds.utils.make_seed(seed, pass_, stream, 1))
            samples = wds.filters._shuffle(samples, shuffle_buffer, min(shuffle_buffer, 100), rng)
        taken = 0
        for taken, sample in enumerate(samples, start=1):
            if pass_ == first_pass and taken <= skip:
                continue
            yield (pass_, taken), sample
        if taken == 0:
            raise UnreadableData(f"data stream {stream} has no readable sample in its {len(urls)} shard(s) "
                                 f"({_named(urls)})")


def _named(urls: list[str]) -> str:
    return ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")


@dataclass
class Chunk:
    """What a worker sends per stream and step: where the stream stands. The samples themselves are already in
    the step's slot of the :class:`BatchRing`."""

    step: int
    stream: int
    position: Position
    skipped: int
    failure: str | None = None  # why the stream cannot go on (raised by ``Assembler``, in the main process)


@dataclass(frozen=True)
class StreamSettings:
    """How every stream is read, shuffled and cut into chunks: the same on every rank, from the train section."""

    streams: int
    chunk_size: int  # the samples each stream gives each batch
    seed: int
    shuffle_buffer: int
    image_views: int = 1
    text_views: int = 1
    cache_bytes: int = 0  # decoded samples each data-loader worker keeps for the next passes

    @classmethod
    def from_config(cls, train: TrainConfig) -> StreamSettings:
        return cls(streams=train.data_streams, chunk_size=train.batch_size // train.data_streams, seed=train.seed,
                   shuffle_buffer=train.shuffle_buffer, image_views=train.image_views,
                   text_views=train.text_views, cache_bytes=train.sample_cache_mb << 20)


@dataclass(frozen=True)
class StreamStart:
    """Where this rank's streams stand: the streams it owns, the step they start at, and their positions (a
    checkpoint's; a stream without one starts at its beginning)."""

    owned: list[int]
    step: int = 0
    positions: dict[int, Position] = field(default_factory=dict)


class StreamChunks(torch.utils.data.IterableDataset):
    """Per step, one chunk of ``settings.chunk_size`` decoded samples from each stream this rank owns (split over
    the data-loader workers)."""

    def __init__(self, per_stream: list[list[str]], settings: StreamSettings, start: StreamStart,
                 images: TrainImages, tokenizer: Callable, ring: BatchRing, gate: WorkerGate | None = None):
        super().__init__()
        self.per_stream = per_stream  # each stream's shards (stream_shards, or mixed_streams for several sources)
        self.settings, self.start = settings, start
        self.images, self.tokenizer, self.ring, self.gate = images, tokenizer, ring, gate
        self.cache = SampleCache(settings.cache_bytes)  # each data-loader worker fills its own copy

    def __iter__(self) -> Iterator[list[Chunk]]:
        """Per step, one item: the chunks of this worker's streams. One item per worker per step, whatever the
        split of streams over workers, keeps the DataLoader's round robin in step with the batches: were the
        chunks items, a worker with fewer streams would run ahead by one step per step, and its chunks wait in
        the main process without bound."""
        info = torch.utils.data.get_worker_info()
        mine = self.start.owned if info is None else self.start.owned[info.id :: info.num_workers]
        if not mine:
            return
        handler, settings, positions = SkipCounter(), self.settings, self.start.positions
        sources = {v: raw_stream(self.per_stream[v], v, settings.seed, settings.shuffle_buffer,
                                 positions.get(v, (0, 0)), handler, self.cache) for v in mine}
        decoded_in = {v: positions.get(v, (0, 0))[0] for v in mine}  # the last pass that decoded a sample
        for step in count(self.start.step):
            if self.gate is not None:
                self.gate.wait()
            chunks = []
            for v in mine:
                chunks.append(self._chunk(step, v, sources[v], handler, decoded_in))
                if chunks[-1].failure:
                    yield chunks
                    return
            yield chunks

    def _chunk(self, step: int, stream: int, source: Iterator, handler: SkipCounter,
               decoded_in: dict[int, int]) -> Chunk:
        seed = wds.utils.make_seed(self.settings.seed, step, stream)  # augmentation resumes exactly
        torch.manual_seed(seed)  # the caption draws
        crops = random.Random(seed)
        images, texts, taken, position, skipped = [], [], [], None, 0
        while len(taken) < self.settings.chunk_size:
            try:
                position, sample = next(source)
            except UnreadableData as err:
                return Chunk(step, stream, (0, 0), skipped, failure=str(err))
            if position[0] > decoded_in[stream] + 1:  # a whole pass went by without one decodable sample
                urls = self.per_stream[stream]
                return Chunk(step, stream, position, skipped, failure=(
                    f"data stream {stream} read a whole pass of its {len(urls)} shard(s) ({_named(urls)}) "
                    f"without one decodable sample ({handler.skipped} skipped: {handler.reasons}); check them "
                    f"with `cloob data validate`"))
            try:
                image = self.cache.image(sample, IMAGE_KEYS, self.images.decode)
                views = [self.images.crop(image, crops) for _ in range(self.settings.image_views)]  # independent draws
                captions = ([_text(sample)] if self.settings.text_views == 1  # the metadata is parsed only when needed
                            else draw_captions(sample_captions(sample), self.settings.text_views))
            except Exception as err:  # a corrupt sample is skipped and counted, never fatal
                handler(err)
                skipped += 1
                continue
            images.extend(views)
            texts.extend(captions)
            taken.append(sample)
            decoded_in[stream] = position[0]
        place = self.start.owned.index(stream)  # the chunk's place in the batch: stream order
        self.ring.write(step, place * len(images), images, place * len(texts), self._tokens(taken, texts))
        return Chunk(step, stream, position, skipped)

    def _tokens(self, samples: list[dict[str, Any]], texts: list[str]) -> torch.Tensor:
        """Sample-major tokens (a sample's views adjacent, as the objectives expect). With one text view the
        caption is the sample's own, so its row is kept with the sample for the next pass."""
        if self.settings.text_views > 1:
            return self.tokenizer(texts)
        missing = [i for i, sample in enumerate(samples) if TOKENS not in sample]
        if missing:
            for i, row in zip(missing, self.tokenizer([texts[i] for i in missing]), strict=True):
                self.cache.keep_tokens(samples[i], row.clone())  # not a view pinning the whole batch
        return torch.stack([sample[TOKENS] for sample in samples])


def _text(sample: dict[str, Any]) -> str:
    return sample["txt"].decode("utf-8") if isinstance(sample["txt"], bytes) else str(sample["txt"])


def sample_captions(sample: dict[str, Any]) -> list[str]:
    """The sample's caption (``txt``) first, then the distinct others its metadata lists under ``captions``
    (a manifest column of lists, or of JSON arrays in CSV/TSV, travels into the shards' ``.json``)."""
    captions = [_text(sample)]
    if "json" in sample:
        listed = json.loads(sample["json"]).get("captions")
        if isinstance(listed, str):
            listed = json.loads(listed) if listed.strip().startswith("[") else [listed]
        for caption in listed or []:
            if isinstance(caption, str) and caption.strip() and caption not in captions:
                captions.append(caption)
    return captions


def draw_captions(captions: list[str], views: int) -> list[str]:
    """``views`` captions: distinct ones in a random order while there are enough, then repeats (seeded by the
    chunk's torch seed, so it resumes exactly)."""
    if views == 1:
        return captions[:1]
    order = torch.randperm(len(captions)).tolist()
    return [captions[order[i % len(order)]] for i in range(views)]


@dataclass
class Batch:
    step: int
    images: torch.Tensor  # uint8 [N, 3, size, size], channels-last: a view of the ring's slot
    tokens: torch.Tensor  # a view of the ring's slot
    positions: dict[int, Position]
    skipped: int
    ring: BatchRing = field(repr=False)

    def to(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and tokens on ``device``, apart from the slot (which the next batch releases)."""
        return self.ring.to_device(self.images, device), self.ring.to_device(self.tokens, device)


class Assembler:
    """Each worker's chunks of each step, from any worker in any order, to this rank's batches in step order: a
    step's batch is its ring slot once every owned stream's chunk of it has arrived. Asking for the next batch
    releases the previous one's slot."""

    def __init__(self, owned: list[int], ring: BatchRing) -> None:
        self.owned, self.ring = owned, ring
        self._pending: dict[int, dict[int, Chunk]] = {}

    @property
    def waiting(self) -> int:
        """Chunks received and not yet part of a batch."""
        return sum(len(chunks) for chunks in self._pending.values())

    def batches(self, items: Iterator[list[Chunk]]) -> Generator[Batch, None, None]:
        next_step = None
        for chunks in items:
            for chunk in chunks:
                if chunk.failure:
                    raise UnreadableData(chunk.failure)
                if next_step is None:
                    next_step = chunk.step
                self._pending.setdefault(chunk.step, {})[chunk.stream] = chunk
            while next_step in self._pending and len(self._pending[next_step]) == len(self.owned):
                parts = [self._pending[next_step][v] for v in self.owned]
                del self._pending[next_step]
                yield Batch(next_step, *self.ring.batch(next_step), {p.stream: p.position for p in parts},
                            sum(p.skipped for p in parts), self.ring)
                self.ring.release(next_step)
                next_step += 1
