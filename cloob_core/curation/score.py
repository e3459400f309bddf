"""`cloob data score`: every sample of a pool of shards scored by a model, a part per shard
(:mod:`cloob_core.curation.score_table`).

The shards stream through data-loader workers as an evaluation's do (:func:`image_batches`): a worker decodes a
sample, transforms it for the model and describes it (:class:`Describer`: hashes, size, language, tokens); the main
process embeds the batch's images and captions and keeps each shard's rows until the worker that read it marks its
end, then writes the shard's part. Memory holds the shards in flight (about one per worker), not the pool.

A run scores the shards of its partition (``--partition i/n``, the contiguous ranges of `cloob data download`)
that have no part of the same shard and model: a killed run scores only what it lacks, and a grown pool only its
new shards. The run that finds every shard of the pool scored writes the index, so the partitions' last pod (or a
run without ``--partition`` after them) completes the folder.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from cloob_core import lease, storage
from cloob_core.config import ConfigError
from cloob_core.curation.facts import Describer, SampleFacts, warm_up
from cloob_core.curation.pool import ShardChanged, samples_as_scored
from cloob_core.curation.score_table import (
    FACTS,
    ModelStamp,
    PartRecord,
    ScoreIndex,
    ScoresError,
    part_sizes,
    read_part_record,
    read_part_table,
    schema,
    write_index,
    write_part,
    write_part_record,
)
from cloob_core.data.manifest import Partition
from cloob_core.data.shard_files import (
    SkipCounter,
    shard_entry,
    shard_list,
    shard_listings,
    shard_sizes,
    shards_fingerprint,
)
from cloob_core.errors import StageError
from cloob_core.evaluation.image_loader import SHARD_STRIDE, Batch, Unreadable, image_batches, readers_per_shard
from cloob_core.evaluation.inputs import ImageSet, Record, ShardStream, sample_image
from cloob_core.memory_limit import naming_killed_workers
from cloob_core.model.source import EvalModel, ModelSource, load_model
from cloob_core.threads import CoreBalance, plan_eval_threads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoreRequest:
    """What to score (``shards``: a folder with sizes.json or of .tar files, a brace pattern; local or s3://), with
    what (``model``, as `cloob eval` names one), into which folder, which share of it, and how."""

    shards: str
    model: ModelSource
    output: str
    partition: Partition = field(default_factory=Partition)
    batch_size: int = 256
    workers: int | None = None  # None: as the thread budget gives (cloob_core.threads.plan_eval_threads)
    progress: bool = True


@dataclass(frozen=True)
class ScoreResult:
    output: str
    shards: int  # in the pool
    owned: int  # in this run's partition
    scored: int  # scored by this run
    rows: int  # samples this run scored
    unreadable: int  # samples or tars this run could not read
    index: ScoreIndex | None  # written by this run (every shard of the pool has its part), else None
    seconds: float

    @property
    def lines(self) -> list[str]:
        rate = self.rows / self.seconds if self.seconds > 0 else 0.0
        lines = [f"scored {self.scored} of this run's {self.owned} shard(s) ({self.owned - self.scored} had their "
                 f"part): {self.rows:,} samples in {self.seconds:.1f} s ({rate:,.0f}/s), {self.unreadable:,} "
                 "unreadable"]
        if self.index is not None:
            lines.append(f"every shard of the pool is scored: {self.index.rows:,} samples in {len(self.index.parts)} "
                         f"part(s), index {storage.join(self.output, 'scores.json')}")
        else:
            lines.append("some shards of the pool are not scored yet (other partitions): the run that scores the "
                         "last of them writes the index")
        return lines


@dataclass(frozen=True)
class _Shard:
    url: str
    name: str
    size: int | None  # bytes, from the listing
    version: str | None
    samples: int | None  # from sizes.json


def _pool(location: str) -> list[_Shard]:
    urls, _ = shard_list(location)
    counts = None if "{" in location or location.endswith(".tar") else shard_sizes(location)
    listings = shard_listings(urls)
    shards = []
    for url in urls:
        entry = shard_entry(listings, url)
        name = url.rpartition("/")[2].removesuffix(".tar")
        shards.append(_Shard(url, name, None if entry is None else entry[0], None if entry is None else entry[1],
                             None if counts is None else counts.get(url)))
    names = [shard.name for shard in shards]
    repeated = next((name for name in names if names.count(name) > 1), None) if len(set(names)) < len(names) else None
    if repeated is not None:
        raise ConfigError(f"--shards {location}: two shards are named {repeated}.tar (from different folders); a "
                          "scores folder keeps a part per shard name, so give shards with distinct names")
    return shards


def _owner(partition: Partition) -> str:
    """The partition's lease on the scores folder: partitions score side by side, a partition runs once."""
    return f"score-p{partition.index}of{partition.count}"


def _done(output: str, shard: _Shard, stamp: ModelStamp, sizes: dict[str, int]) -> PartRecord | None:
    """The shard's part where it is there, of the shard as it is now, its files as its record has them
    (``sizes``: :func:`part_sizes`); a part by another model is refused. A shard whose file time changed (a
    copied pool) keeps its part when its samples are the ones scored, and its record takes the new time."""
    record = read_part_record(output, shard.name)
    if record is None:
        return None
    if not record.model.same_model(stamp):
        raise ScoresError(f"{output} holds scores by another model ({record.model.architecture}, weights "
                          f"{record.model.fingerprint}; this run's: {stamp.architecture}, {stamp.fingerprint}): give "
                          "a new --output for this model's scores")
    if not record.files_match(output, sizes):
        log.info("%s: its part's files are missing or not as its record has them: scoring it again", shard.url)
        return None
    if record.facts != FACTS:
        log.info("%s: its part's facts are of an earlier definition (%s, now %s: the language, the words): scoring "
                 "it again", shard.url, record.facts, FACTS)
        return None
    if (record.shard_size, record.shard_version) == (shard.size, shard.version):
        return record
    why = _content_differs(output, shard, record)
    if why is not None:
        log.info("%s changed since it was scored (%s): scoring it again", shard.url, why)
        return None
    log.info("%s: its file's version changed since it was scored (%s, now %s) but its samples did not (a copy): its "
             "part is kept", shard.url, record.shard_version, shard.version)
    record = replace(record, shard_version=shard.version)
    write_part_record(output, record)
    return record


def _content_differs(output: str, shard: _Shard, record: PartRecord) -> str | None:
    """How the shard differs from what its part was scored from, or None where it does not: its size, then each
    scored sample's key, image digest and caption at its position (the tar read once, no image decoded)."""
    if record.shard_size != shard.size:
        return f"{record.shard_size} bytes then, {shard.size} now"
    rows = read_part_table(output, record).select(["position", "key", "sha256", "caption"]).to_pylist()
    try:
        for _ in samples_as_scored(shard.url, rows, again=""):
            pass
    except ShardChanged as err:
        return err.why
    return None


def score(request: ScoreRequest, model: EvalModel | None = None) -> ScoreResult:
    """Score the partition's shards that lack a part; write the index when the whole pool has its parts. ``model``:
    ``request.model`` already loaded (a pipeline's step names the output by its fingerprint)."""
    started = time.monotonic()
    storage.check_apart(("--output", request.output), ("--shards", request.shards))
    shards = _pool(request.shards)
    model = model or load_model(request.model)
    stamp = ModelStamp(model.fingerprint, model.architecture, model.precision, model.config_digest())
    partition = request.partition
    with lease.writing(request.output, _owner(partition),
                       f"partition {partition.index}/{partition.count} of {request.output}"):
        owned = [shards[i] for i in partition.shards(len(shards))]
        sizes = part_sizes(request.output)
        todo = [shard for shard in owned if _done(request.output, shard, stamp, sizes) is None]
        scoring = _Scoring(request, model, stamp, todo)
        if todo:
            scoring.run()
        index = _index_if_complete(request.output, shards, stamp)
    result = ScoreResult(request.output, len(shards), len(owned), len(todo) - len(scoring.failed), scoring.rows,
                         scoring.skips.skipped, index, time.monotonic() - started)
    if scoring.failed:
        name, why = next(iter(scoring.failed.items()))
        url = next(shard.url for shard in owned if shard.name == name)
        raise ShardsNotRead(f"{len(scoring.failed)} of this run's {len(owned)} shard(s) could not be read from "
                            f"storage, so they have no part: {url} ({why}); the rest are scored: run the same command "
                            "again to score them", details="\n".join(result.lines))
    return result


class ShardsNotRead(StageError):
    """Shards that storage did not give whole (a network or storage fault after the tries): left without a part,
    for the next run to score; the run's exit status says so (1: not the user's mistake, and a pipeline tries the
    step again)."""

    exit_code = 1

    def __init__(self, message: str, details: str):
        super().__init__(message)
        self.details = details


def _index_if_complete(output: str, shards: list[_Shard], stamp: ModelStamp) -> ScoreIndex | None:
    """The index, written, when every shard has its part by this model; else None. Its bytes do not depend on
    which run writes it (the partitions' last ones may both do)."""
    records, sizes = [], part_sizes(output)
    for shard in shards:
        record = _done(output, shard, stamp, sizes)
        if record is None:
            return None
        records.append(record)
    widths = {record.width for record in records if record.rows}
    if len(widths) > 1:
        raise ScoresError(f"{output} holds embeddings of widths {sorted(widths)}: parts of different models")
    index = ScoreIndex(records[0].model, shards_fingerprint([shard.url for shard in shards]),
                       widths.pop() if widths else 0, records)
    write_index(output, index)
    return index


def _scored_sample(raw: dict[str, Any]) -> tuple[bytes, Record]:
    """A pool sample's image (its caption and the rest come from :class:`Describer`)."""
    return sample_image(raw), Record()


@dataclass
class _Rows:
    """A shard's rows as its batches arrive, by position in the shard."""

    positions: list[int] = field(default_factory=list)
    facts: list[SampleFacts] = field(default_factory=list)
    scores: list[np.ndarray] = field(default_factory=list)
    image: list[np.ndarray] = field(default_factory=list)
    text: list[np.ndarray] = field(default_factory=list)
    ends: int = 0  # workers that marked the shard's end


class _Scoring:
    """One run's scoring of its shards: the stream, the rows in flight, the parts written."""

    def __init__(self, request: ScoreRequest, model: EvalModel, stamp: ModelStamp, todo: list[_Shard]):
        self.request, self.model, self.stamp, self.todo = request, model, stamp, todo
        self.skips = SkipCounter()
        self.rows = 0
        self.failed: dict[str, str] = {}  # shard name -> why storage did not give it

    def run(self) -> None:
        request, model = self.request, self.model
        budget = plan_eval_threads(model.device.type, request.workers).apply()
        balance = CoreBalance(budget.cores, budget.torch_threads) \
            if model.device.type == "cpu" and budget.workers else None
        stream = ShardStream(tuple(shard.url for shard in self.todo), request.shards, _scored_sample,
                             None if any(shard.samples is None for shard in self.todo)
                             else tuple(int(shard.samples or 0) for shard in self.todo))
        images = ImageSet(name=Path(request.shards.rstrip("/")).name or request.shards, identity="", reader=stream)
        readers = readers_per_shard(len(self.todo), budget.workers)
        warm_up()  # the hash's and the identifier's imports and model, once here: forked workers inherit them
        total = sum(shard.samples or 0 for shard in self.todo) or None
        bar = tqdm(total=total, desc="score", unit="img", disable=not request.progress)
        batches = image_batches(images, model.transform, batch_size=request.batch_size, workers=budget.workers,
                                pin_memory=model.device.type == "cuda",
                                describe=Describer(model.tokenizer), mark_ends=True)
        with contextlib.closing(batches), naming_killed_workers(
                lambda killed: f"scoring {request.shards}: {killed}: lower --workers (here {budget.workers}) or "
                f"--batch-size (here {request.batch_size})"):
            self._consume(batches, readers, balance, bar)
        bar.close()

    def _consume(self, batches: Iterator[Batch], readers: int, balance: CoreBalance | None, bar: tqdm) -> None:
        in_flight: dict[int, _Rows] = {}
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            arrived = time.perf_counter()
            for why, lost in batch.unreadable:
                self.skips(Unreadable(why), lost)
            if len(batch.keys):
                self._embed(batch, in_flight)
            for shard, why in batch.failed or ():
                self.failed.setdefault(self.todo[shard].name, why)
            for shard in batch.ended or ():
                rows = in_flight.setdefault(shard, _Rows())
                rows.ends += 1
                if rows.ends == readers:
                    finished = in_flight.pop(shard)
                    if self.todo[shard].name not in self.failed:  # a shard storage did not give has no part
                        self._write(self.todo[shard], finished)
            if balance is not None:
                balance.record(arrived - waited, time.perf_counter() - arrived)
            bar.update(len(batch.keys) + sum(lost for _, lost in batch.unreadable))
        if in_flight:  # every shard's end is marked before the stream ends
            raise AssertionError(f"shards {sorted(in_flight)} were not marked as read")

    @torch.no_grad()
    def _embed(self, batch: Batch, in_flight: dict[int, _Rows]) -> None:
        facts: list[SampleFacts] = batch.facts or []
        image = self.model.encode_images(batch.images)
        text = self.model.encode_texts(torch.stack([fact.tokens for fact in facts]))
        scores = (image * text).sum(dim=1).cpu().numpy()
        image16, text16 = image.cpu().half().numpy(), text.cpu().half().numpy()
        for row, (key, fact) in enumerate(zip(batch.keys.tolist(), facts, strict=True)):
            shard, position = divmod(key, SHARD_STRIDE)
            rows = in_flight.setdefault(shard, _Rows())
            rows.positions.append(position)
            rows.facts.append(fact)
            rows.scores.append(scores[row])
            rows.image.append(image16[row])
            rows.text.append(text16[row])

    def _write(self, shard: _Shard, rows: _Rows) -> None:
        import pyarrow as pa

        order = np.argsort(np.asarray(rows.positions, dtype=np.int64), kind="stable")
        facts = [rows.facts[i] for i in order]
        columns: dict[str, Any] = {
            "key": [f.key for f in facts], "shard": [shard.name] * len(facts),
            "position": [rows.positions[i] for i in order], "url": [f.url for f in facts],
            "caption": [f.caption for f in facts], "sha256": [f.sha256 for f in facts],
            "clip_score": [float(rows.scores[i]) for i in order], "caption_words": [f.caption_words for f in facts],
            "caption_chars": [f.caption_chars for f in facts], "language": [f.language for f in facts],
            "language_confidence": [f.language_confidence for f in facts], "phash": [f.phash for f in facts],
            "width": [f.width for f in facts], "height": [f.height for f in facts],
        }
        table = pa.Table.from_pydict(columns, schema=schema())
        width = len(rows.image[0]) if facts else 0
        image = np.stack([rows.image[i] for i in order]) if facts else np.zeros((0, 0), np.float16)
        text = np.stack([rows.text[i] for i in order]) if facts else np.zeros((0, 0), np.float16)
        unreadable = None if shard.samples is None else shard.samples - len(facts)
        lease.check_held(self.request.output, _owner(self.request.partition))
        write_part(self.request.output, partial(PartRecord, shard.name, shard.size, shard.version, len(facts),
                                                unreadable, width, self.stamp, facts=FACTS), table, image, text)
        self.rows += len(facts)
