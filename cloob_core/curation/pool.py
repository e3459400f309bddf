"""A scored pool as the curation filters read it: the score table of every part, each checked against its index,
as one DuckDB view (``scores``) that the engine streams column by column, within its memory limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloob_core.curation.score_table import ScoreIndex, ScoresError, check_part_file, part_file, read_index
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
    files = []
    for part in index.parts:
        location = part_file(scores, part.name, ".parquet")
        check_part_file(location, part.table_sha256)
        files.append(location)
    listed = ", ".join("'" + file.replace("'", "''") + "'" for file in files)
    connection.execute(f"CREATE VIEW {SCORES_VIEW} AS SELECT * FROM read_parquet([{listed}])")
    return ScoredPool(shards, scores, index, connection)


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
