"""SemDeDup (Abbas et al. 2023): the image embeddings clustered by k-means; within a cluster, of images whose
cosine is above ``1 - eps``, the one with the highest image-text cosine is kept (ties by place in the pool), the
others removed. Duplicates in meaning, not in pixels: the same photo cropped, the same product on another
background.

Memory stays flat in the pool: k-means is fitted on a sample (:func:`~cloob_core.curation.clusters.fit_centroids`);
then each part's embeddings are assigned to their nearest centroid and written to
one of :data:`BUCKETS` spill files by cluster; each bucket is read alone and its clusters compared, a block of rows
at a time. What grows with the pool is the spill folder (the embeddings once more, float16).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cloob_core import scratch
from cloob_core.curation.clusters import TooFewSamples, fit_centroids, nearest
from cloob_core.curation.pool import SCORES_VIEW, ScoredPool
from cloob_core.curation.score_table import read_part_rows

ROWS_PER_CLUSTER = 5_000  # the default number of clusters: one per this many samples
BUCKETS = 64
BLOCK = 4_096  # rows compared at a time within a cluster
_REMOVED = "semantic_removed"
_ROW = np.dtype([("shard", np.int64), ("position", np.int64), ("cluster", np.int64), ("score", np.float32)])


@dataclass(frozen=True)
class SemanticDedup:
    """Removes each image with a better-scored image of its cluster whose embedding's cosine is above 1 - eps."""

    eps: float
    clusters: int | None = None  # None: one per ROWS_PER_CLUSTER samples
    seed: int = 0
    reason: str = "semantic_duplicate"
    setting: str = "semantic_dedup_eps"

    def removed(self, pool: ScoredPool) -> str:
        clusters = self.clusters or max(1, math.ceil(pool.rows / ROWS_PER_CLUSTER))
        if pool.rows < clusters:
            raise TooFewSamples(f"curation.semantic_dedup_clusters {clusters} is more than the pool's {pool.rows} "
                                "samples: lower it (or leave it null: one cluster per "
                                f"{ROWS_PER_CLUSTER:,} samples)")
        import pyarrow as pa

        names = np.array([part.name for part in pool.index.parts], dtype=object)
        connection = pool.connection
        connection.execute(f"""CREATE OR REPLACE TEMP TABLE {_REMOVED} (shard VARCHAR, position INTEGER,
                               better_shard VARCHAR, better_position INTEGER, cosine FLOAT, cluster BIGINT)""")
        with scratch.folder("cloob-semdedup") as spill:
            centroids = fit_centroids(pool, clusters, self.seed)
            _assign(pool, centroids, Path(spill))
            for removed, better, cosine in _compare(pool, Path(spill), 1.0 - self.eps):  # a bucket's at a time
                connection.register("semantic_batch", pa.table({
                    "shard": names[removed["shard"]].tolist(), "position": removed["position"].astype(np.int32),
                    "better_shard": names[better["shard"]].tolist(),
                    "better_position": better["position"].astype(np.int32), "cosine": cosine,
                    "cluster": removed["cluster"]}))
                connection.execute(f"INSERT INTO {_REMOVED} SELECT * FROM semantic_batch")
                connection.unregister("semantic_batch")
        return f"""SELECT r.shard, r.position, printf('cosine %.4f with %s (better scored, cluster %d)', r.cosine,
                   s.key, r.cluster) AS evidence FROM {_REMOVED} r JOIN {SCORES_VIEW} s
                   ON s.shard = r.better_shard AND s.position = r.better_position"""


def _assign(pool: ScoredPool, centroids: np.ndarray, spill: Path) -> None:
    """Each row's nearest centroid (by cosine), written with its place and score to its cluster's bucket, and its
    embedding beside it."""
    with contextlib.ExitStack() as stack:
        rows = [stack.enter_context(open(spill / f"{b}.rows", "wb")) for b in range(BUCKETS)]
        vectors = [stack.enter_context(open(spill / f"{b}.f16", "wb")) for b in range(BUCKETS)]
        for number, part in enumerate(pool.index.parts):
            part_rows = read_part_rows(pool.scores, part, pool.index.embedding_width)
            image = part_rows.image
            closest = nearest(image, centroids)
            record = np.zeros(len(image), _ROW)
            record["shard"], record["position"], record["cluster"], record["score"] = \
                number, part_rows.positions, closest, part_rows.clip_scores
            for bucket in np.unique(closest % BUCKETS):
                mine = closest % BUCKETS == bucket
                rows[bucket].write(record[mine].tobytes())
                vectors[bucket].write(np.ascontiguousarray(image[mine]).tobytes())


def _compare(pool: ScoredPool, spill: Path, threshold: float) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The rows removed, a bucket's at a time: in each cluster, those with a better-ranked member above
    ``threshold`` cosine; with each, its most similar better-ranked member and their cosine."""
    width = pool.index.embedding_width
    for bucket in range(BUCKETS):
        rows = np.fromfile(spill / f"{bucket}.rows", _ROW)
        if not len(rows):
            continue
        vectors = np.fromfile(spill / f"{bucket}.f16", np.float16).reshape(len(rows), width)
        # best first: the highest score, then the place in the pool (NaN last)
        order = np.lexsort((rows["position"], rows["shard"], -np.nan_to_num(rows["score"], nan=-np.inf),
                            rows["cluster"]))
        rows, vectors = rows[order], vectors[order]
        starts = np.flatnonzero(np.r_[True, rows["cluster"][1:] != rows["cluster"][:-1]])
        removed, better, cosines = [], [], []
        for start, end in zip(starts, np.r_[starts[1:], len(rows)], strict=True):
            members = vectors[start:end].astype(np.float32)
            members /= np.maximum(np.linalg.norm(members, axis=1, keepdims=True), 1e-12)
            for block in range(0, len(members), BLOCK):
                similar = members[block:block + BLOCK] @ members[:block + BLOCK].T
                # a row is a duplicate of any member ranked before it (to its left, not itself)
                ahead = np.tril(np.ones_like(similar, dtype=bool), k=block - 1)
                similar = np.where(ahead, similar, -np.inf)
                nearest_ahead = similar.argmax(axis=1)
                cosine = similar[np.arange(len(similar)), nearest_ahead]
                duplicate = cosine > threshold
                removed.append(rows[start + block:start + block + len(similar)][duplicate])
                better.append(rows[start + nearest_ahead[duplicate]])
                cosines.append(cosine[duplicate])
        yield np.concatenate(removed), np.concatenate(better), np.concatenate(cosines).astype(np.float32)
