"""DataComp's image-based filter: the pool's image embeddings clustered by k-means; the clusters nearest to the
images of a reference set (DataComp: ImageNet's training images) are the target; a sample is kept when its own
nearest centroid is one of them. It pulls a pool towards the distribution of the images a user cares about.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cloob_core.curation.clusters import TooFewSamples, fit_centroids, nearest
from cloob_core.curation.pool import ScoredPool, check_scoring_model
from cloob_core.curation.score_table import read_part_rows
from cloob_core.evaluation.features import Encoding, image_features
from cloob_core.evaluation.inputs import ImageSet
from cloob_core.model.source import EvalModel

ROWS_PER_CLUSTER = 1_000  # the default number of clusters: one per this many samples (DataComp: 100,000 for 12.8M)
_REMOVED = "off_target"


@dataclass(frozen=True)
class TargetDistribution:
    """Removes samples whose nearest centroid is nearest to no image of ``reference``."""

    reference: ImageSet
    model: EvalModel
    clusters: int | None = None
    seed: int = 0
    workers: int = 0
    reason: str = "target_distribution"
    setting: str = "target_images"

    def removed(self, pool: ScoredPool) -> str:
        import pyarrow as pa

        check_scoring_model(self.model, pool, "the target distribution")
        clusters = self.clusters or max(1, math.ceil(pool.rows / ROWS_PER_CLUSTER))
        if pool.rows < clusters:
            raise TooFewSamples(f"curation.target_clusters {clusters} is more than the pool's {pool.rows} samples: "
                                "lower it")
        centroids = fit_centroids(pool, clusters, self.seed)
        reference = image_features(self.model, self.reference, Encoding(progress=False, workers=self.workers))
        targets = np.unique(nearest(reference.features.numpy(), centroids))
        connection = pool.connection
        connection.execute(f"CREATE OR REPLACE TEMP TABLE {_REMOVED} (shard VARCHAR, position INTEGER, cluster BIGINT)")
        for part in pool.index.parts:
            rows = read_part_rows(pool.scores, part, pool.index.embedding_width)
            closest = nearest(rows.image, centroids)
            off = ~np.isin(closest, targets)
            if off.any():
                connection.register("off_rows", pa.table({"shard": [part.name] * int(off.sum()),
                                                          "position": rows.positions[off], "cluster": closest[off]}))
                connection.execute(f"INSERT INTO {_REMOVED} SELECT shard, position, cluster FROM off_rows")
                connection.unregister("off_rows")
        return (f"SELECT shard, position, printf('nearest centroid %d of {clusters:,}: no image of the target set "
                f"is nearest it', cluster) AS evidence FROM {_REMOVED}")
