"""A scored pool as the curation filters read it: the score table of every part, each checked against its index,
as one DuckDB view (``scores``) that the engine streams column by column, within its memory limit."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloob_core.curation.score_table import (
    FACTS,
    ScoreIndex,
    ScoresError,
    check_part_file,
    part_file,
    read_index,
)
from cloob_core.data.shard_files import shard_list, shards_fingerprint

if TYPE_CHECKING:
    import duckdb

    from cloob_core.model.source import EvalModel

SCORES_VIEW = "scores"


@dataclass(frozen=True)
class ScoredPool:
    """The pool's shards, their scores' index, and the engine connection whose ``scores`` view holds the table."""

    shards: str
    scores: str
    index: ScoreIndex
    connection: duckdb.DuckDBPyConnection
    urls: dict[str, str]  # each shard's URL by its name (the part's name), from the one listing of the pool

    @property
    def rows(self) -> int:
        return self.index.rows


def open_pool(shards: str, scores: str, connection: duckdb.DuckDBPyConnection) -> ScoredPool:
    """The pool ``shards`` with its scores ``scores``: the index read, the pool's fingerprint compared with the one
    scored, every part's table checked, and the view ``scores`` created on ``connection``."""
    index = read_index(scores)
    urls, _ = shard_list(shards)
    if shards_fingerprint(urls) != index.shards_fingerprint:
        raise ScoresError(f"the scores in {scores} were made for other shards than {shards} (their names or sizes "
                          "differ): score these shards (`cloob data score`, the same --output scores only what "
                          "changed) or give their own scores")
    earlier = next((part for part in index.parts if part.facts != FACTS), None)
    if earlier is not None:
        raise ScoresError(f"{scores} was scored by an earlier cloob: its facts (the language, the words) are "
                          f"{earlier.facts}, now {FACTS}; run `cloob data score` again with the same --output (it "
                          "scores such parts again)")
    files = []
    for part in index.parts:
        location = part_file(scores, part.name, ".parquet")
        check_part_file(location, part.table_sha256)
        files.append(location)
    listed = ", ".join("'" + file.replace("'", "''") + "'" for file in files)
    connection.execute(f"CREATE VIEW {SCORES_VIEW} AS SELECT * FROM read_parquet([{listed}])")
    return ScoredPool(shards, scores, index, connection,
                      {url.rpartition("/")[2].removesuffix(".tar"): url for url in urls})


class ShardChanged(ScoresError):
    """A shard whose samples are not the ones its scores were made of; ``why``: how."""

    def __init__(self, url: str, why: str, again: str):
        super().__init__(f"{url} changed since it was scored ({why}): {again}")
        self.why = why


def scored_samples(pool: ScoredPool, shard: str, rows: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any],
                                                                                              dict[str, Any]]]:
    """``(row, sample)`` for each of ``rows`` (score-table rows of shard ``shard``, in position order), the
    sample read from the tar as scoring read it: webdataset's grouping of members into samples, at the row's
    position, its key, image and caption checked against what was scored. A shard that changed since is
    :class:`ShardChanged`, naming it and the command that scores it again; a read fault is raised as it is."""
    again = (f"`cloob data score --shards {pool.shards} --output {pool.scores}` scores it again (only the shards that "
             "changed), then curate")
    yield from samples_as_scored(pool.urls[shard], rows, again)


def sample_images(pool: ScoredPool, shard: str, positions: list[int]) -> dict[int, bytes]:
    """The image bytes of shard ``shard``'s samples at ``positions``, its tar read once (:func:`scored_samples`)."""
    from cloob_core.evaluation.inputs import sample_image

    if not positions:
        return {}
    wanted = pool.connection.execute(
        f"SELECT position, key, sha256, caption FROM {SCORES_VIEW} WHERE shard = ? AND position IN "
        f"({', '.join(str(int(p)) for p in sorted(set(positions)))}) ORDER BY position", [shard]).fetchall()
    rows = [dict(zip(("position", "key", "sha256", "caption"), row, strict=True)) for row in wanted]
    return {row["position"]: sample_image(raw) for row, raw in scored_samples(pool, shard, rows)}


def samples_as_scored(url: str, rows: list[dict[str, Any]], again: str) -> Iterator[tuple[dict[str, Any],
                                                                                         dict[str, Any]]]:
    """:func:`scored_samples` of the tar ``url``; ``again`` ends the line of a :class:`ShardChanged`."""
    import webdataset as wds

    from cloob_core.curation.facts import sample_caption
    from cloob_core.data.shard_files import register_s3
    from cloob_core.evaluation.inputs import sample_image

    register_s3()
    wanted = iter(rows)
    row = next(wanted, None)
    for position, raw in enumerate(wds.tarfile_samples([{"url": url}], handler=wds.reraise_exception)):
        if row is None:
            return
        if position < row["position"]:
            continue
        try:
            image = sample_image(raw)
        except ValueError:  # no image member: not the sample scored (scoring read none there)
            image = b""
        found = (str(raw["__key__"]), hashlib.sha256(image).hexdigest(), sample_caption(raw))
        if found != (row["key"], row["sha256"], row["caption"]):
            what = next(name for name, a, b in zip(("key", "image", "caption"), found,
                                                   (row["key"], row["sha256"], row["caption"]), strict=True) if a != b)
            raise ShardChanged(url, f"its sample {position} has another {what}", again)
        yield row, raw
        row = next(wanted, None)
    if row is not None:
        raise ShardChanged(url, f"it ends before its scored sample {row['position']}", again)


def check_scoring_model(model: EvalModel, pool: ScoredPool, use: str) -> None:
    """``model`` is the one that scored ``pool``: a filter that embeds images of its own (``use``) compares them with
    the stored embeddings, which only that model's live in the same space."""
    width = int(model.model.visual.output_dim)
    scored = pool.index.model
    if width != pool.index.embedding_width:
        raise ScoresError(f"the model given embeds images in {width} dimensions, the scores' embeddings have "
                          f"{pool.index.embedding_width} ({scored.architecture}): {use} compares them, so give the "
                          "model that scored the pool")
    if model.fingerprint != scored.fingerprint:
        raise ScoresError(f"the model given (weights {model.fingerprint}) is not the one that scored the pool (weights "
                          f"{scored.fingerprint}): {use} compares their embeddings, so give the scoring model")
