"""k-means over a scored pool's image embeddings, for the filters that cluster (SemDeDup, the target
distribution): scikit-learn's, fitted on a seeded sample, so that memory holds the sample, not the pool."""

from __future__ import annotations

import numpy as np

from cloob_core.curation.pool import ScoredPool
from cloob_core.curation.score_table import read_part_rows
from cloob_core.errors import StageError


class TooFewSamples(StageError):
    """Fewer samples than k-means clusters."""


FIT_SAMPLE = 200_000  # embeddings k-means is fitted on, at most (faiss's default: 256 per centroid)


def fit_centroids(pool: ScoredPool, clusters: int, seed: int) -> np.ndarray:
    """Unit-norm centroids of k-means fitted on a seeded sample of the pool's image embeddings."""
    from sklearn.cluster import KMeans

    rng = np.random.default_rng(seed)
    share = min(1.0, FIT_SAMPLE / pool.rows)
    sample = []
    width = pool.index.embedding_width
    for part in pool.index.parts:
        image = read_part_rows(pool.scores, part, width).image
        chosen = rng.random(len(image)) < share
        sample.append(image[chosen].astype(np.float32))
    points = np.concatenate(sample) if sample else np.zeros((0, width), np.float32)
    if len(points) < clusters:  # a small pool's sample: take it whole
        points = np.concatenate([read_part_rows(pool.scores, part, width).image.astype(np.float32)
                                 for part in pool.index.parts])
    fitted = KMeans(n_clusters=clusters, n_init=1, random_state=seed).fit(points)
    centroids = fitted.cluster_centers_.astype(np.float32)
    return centroids / np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12)


def nearest(vectors: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Each row's nearest centroid by cosine (the rows and the centroids are unit norm)."""
    if not len(vectors):
        return np.zeros(0, np.int64)
    return np.argmax(vectors.astype(np.float32) @ centroids.T, axis=1)
