"""Decontamination: pool images that are near-duplicates of an evaluation image are removed, so that a benchmark
does not score what training saw. An evaluation image is matched two ways: by perceptual hash within ``bits``
(a re-encoding, a resize), and by the scoring model's image embedding at a cosine of at least ``min_cosine`` (a
crop, a recolouring, a border). The evaluation images are embedded by the model that scored the pool, so that
both embeddings live in one space: a model of another width, or other weights, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from cloob_core.curation.facts import perceptual_hash
from cloob_core.curation.filters.near_duplicates import within_bits
from cloob_core.curation.pool import SCORES_VIEW, ScoredPool, check_scoring_model
from cloob_core.curation.score_table import read_part_rows
from cloob_core.evaluation.features import Encoding, image_features
from cloob_core.evaluation.image_loader import image_batches
from cloob_core.evaluation.inputs import ImageSet
from cloob_core.model.source import EvalModel

_HASHES = "evaluation_hashes"
_MATCHED = "decontaminated_by_embedding"
_BLOCK = 8_192  # evaluation embeddings compared with a part at a time


def _hash_tensor(image: Image.Image) -> torch.Tensor:
    """An image's perceptual hash as the one element of an int64 tensor (its 64 bits as a signed number), so that
    the image loader's workers compute it."""
    return torch.tensor([np.uint64(perceptual_hash(image)).view(np.int64)], dtype=torch.int64)


def evaluation_hashes(images: ImageSet, workers: int) -> np.ndarray:
    """The perceptual hashes (uint64) of every readable image of ``images``."""
    batches = image_batches(images, _hash_tensor, batch_size=256, workers=workers)
    found = [batch.images.reshape(-1).numpy() for batch in batches if len(batch.keys)]
    return (np.concatenate(found) if found else np.zeros(0, np.int64)).view(np.uint64)


@dataclass(frozen=True)
class Decontaminate:
    """Removes pool images matching an image of ``sets`` by hash (within ``bits``) or by embedding."""

    sets: tuple[ImageSet, ...]
    model: EvalModel
    bits: int
    min_cosine: float
    workers: int = 0
    reason: str = "decontaminated"
    setting: str = "decontaminate"

    def removed(self, pool: ScoredPool) -> str:
        check_scoring_model(self.model, pool, "decontamination")
        connection = pool.connection
        hashes = np.concatenate([evaluation_hashes(images, self.workers) for images in self.sets])
        features = torch.cat([image_features(self.model, images, Encoding(progress=False, workers=self.workers))
                              .features for images in self.sets]).numpy()
        import pyarrow as pa

        connection.register(_HASHES, pa.table({"phash": pa.array(hashes, pa.uint64())}))
        connection.execute(f"CREATE OR REPLACE TEMP TABLE {_MATCHED} (shard VARCHAR, position INTEGER)")
        for part in pool.index.parts:
            rows = read_part_rows(pool.scores, part, pool.index.embedding_width)
            image = rows.image
            best = np.full(len(image), -np.inf, np.float32)
            for start in range(0, len(features), _BLOCK):
                block = image.astype(np.float32) @ features[start:start + _BLOCK].T
                best = np.maximum(best, block.max(axis=1, initial=-np.inf))
            matched = rows.positions[best >= self.min_cosine]
            if len(matched):
                connection.register("matched_rows", pa.table({"shard": [part.name] * len(matched),
                                                              "position": matched}))
                connection.execute(f"INSERT INTO {_MATCHED} SELECT shard, position FROM matched_rows")
                connection.unregister("matched_rows")
        by_hash = within_bits(f"(SELECT phash FROM {_HASHES})", f"(SELECT shard, position, phash FROM "
                              f"{SCORES_VIEW})", self.bits)
        return f"SELECT shard, position FROM {_MATCHED} UNION {by_hash}"
