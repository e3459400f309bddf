"""Decontamination: pool images that are copies of an evaluation image are removed, so that a benchmark does not
score what training saw. Candidates come two ways: a 64-bit perceptual hash within ``bits`` (a re-encoding, a
resize) and the scoring model's image embedding at a cosine of at least ``min_cosine`` (a crop, a border, which
move the hash); each pool image keeps its :data:`CANDIDATES` nearest evaluation images by each. Neither tells a
copy from a look-alike (MNIST's training digits lie within 6 bits of a test digit, colour variants of a drawing
share a hash), so each candidate pair is then compared by its pixels (:mod:`cloob_core.curation.copies`) and
removed at a similarity of at least ``min_similarity`` (None: every candidate, without the comparison).

The evaluation images are embedded by the model that scored the pool, so that both embeddings live in one space:
a model of another width, or other weights, is refused. Each evaluation image is held as its hash, its
embedding and a 3 KB view while the pool is read part by part; the pool images of candidate pairs are read back
from their shards, each shard once. Every removal's evidence (the evaluation image, the hash distance, the cosine,
the similarity) is the table :data:`MATCHES`.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from cloob_core.curation.copies import SIDE, copy_similarity, copy_view
from cloob_core.curation.facts import perceptual_hash
from cloob_core.curation.filters.near_duplicates import within_bits
from cloob_core.curation.pool import SCORES_VIEW, ScoredPool, check_scoring_model, sample_images
from cloob_core.curation.score_table import PartRecord, read_part_rows
from cloob_core.evaluation.features import Encoding, image_features
from cloob_core.evaluation.image_loader import image_batches
from cloob_core.evaluation.inputs import ImageSet
from cloob_core.model.source import EvalModel

MATCHES = "decontamination_matches"  # shard, position, evaluation_image, bits, cosine, similarity
CANDIDATES = 3  # evaluation images a pool image is compared with, by each of hash and embedding
_REFERENCE = "evaluation_hashes"
_HASH_CANDIDATES = "decontamination_hash_candidates"
_BLOCK = 8_192  # evaluation embeddings compared with a part at a time
_VIEW = 3 * SIDE * SIDE


def _cropped(image: Image.Image, fraction: float) -> Image.Image:
    dx, dy = round(image.width * fraction), round(image.height * fraction)
    return image.crop((dx, dy, image.width - dx, image.height - dy)) if dx or dy else image


def _bordered(image: Image.Image, colour: str) -> Image.Image:
    return ImageOps.expand(image, border=max(1, round(0.08 * max(image.size))), fill=colour)


# An evaluation image is hashed as it is and as the edits that move its hash most would leave it (a crop, a
# border), so that a pool image edited alike is a candidate by hash: a model's embedding rarely finds them
HASHED_AS: dict[str, Callable[[Image.Image], Image.Image]] = {
    "as it is": lambda image: image,
    "5% cropped off each side": lambda image: _cropped(image, 0.05),
    "10% cropped off each side": lambda image: _cropped(image, 0.10),
    "with a white border of 8%": lambda image: _bordered(image, "white"),
    "with a black border of 8%": lambda image: _bordered(image, "black"),
}


def _reference_tensor(image: Image.Image) -> torch.Tensor:
    """An evaluation image's perceptual hashes (:data:`HASHED_AS`, 8 bytes each, big-endian) and copy view, as one
    uint8 tensor, so that the image loader's workers compute them."""
    digests = b"".join(perceptual_hash(edit(image)).to_bytes(8, "big") for edit in HASHED_AS.values())
    return torch.from_numpy(np.concatenate([np.frombuffer(digests, np.uint8), copy_view(image).reshape(-1)]))


@dataclass(frozen=True)
class EvaluationImages:
    """The readable images of the evaluation sets, in one order: each one's name (``SET:POSITION``), perceptual
    hash, embedding by the scoring model and copy view."""

    names: list[str]
    hashes: np.ndarray  # [N, len(HASHED_AS)] uint64
    features: np.ndarray  # [N, d] float32, unit norm
    views: np.ndarray  # [N, 3, SIDE, SIDE] uint8


def evaluation_images(sets: tuple[ImageSet, ...], model: EvalModel, workers: int) -> EvaluationImages:
    names, hashes, features, views = [], [], [], []
    hash_bytes = 8 * len(HASHED_AS)
    for images in sets:
        batches = [batch for batch in image_batches(images, _reference_tensor, batch_size=256, workers=workers)
                   if len(batch.keys)]
        keys = torch.cat([batch.keys for batch in batches]) if batches else torch.zeros(0, dtype=torch.int64)
        packed = (torch.cat([batch.images for batch in batches]) if batches
                  else torch.zeros((0, hash_bytes + _VIEW), dtype=torch.uint8))[keys.argsort()].numpy()
        embedded = image_features(model, images, Encoding(progress=False, workers=workers)).features.numpy()
        if len(embedded) != len(packed):  # both read the set's readable images, in its order
            raise RuntimeError(f"{images.name}: {len(embedded)} images embedded but {len(packed)} hashed")
        names += [f"{images.name}:{int(key)}" for key in keys.sort().values]
        hashes.append(packed[:, :hash_bytes].copy().view(">u8").astype(np.uint64))
        views.append(packed[:, hash_bytes:].reshape(-1, 3, SIDE, SIDE))
        features.append(embedded.astype(np.float32))
    width = int(model.model.visual.output_dim)
    return EvaluationImages(
        names, np.concatenate(hashes) if hashes else np.zeros((0, len(HASHED_AS)), np.uint64),
        np.concatenate(features) if features else np.zeros((0, width), np.float32),
        np.concatenate(views) if views else np.zeros((0, 3, SIDE, SIDE), np.uint8))


def _nearest_by_cosine(image: np.ndarray, features: np.ndarray, min_cosine: float) -> set[tuple[int, int]]:
    """``(row, evaluation)`` of each row's CANDIDATES most similar evaluation images at ``min_cosine`` or more."""
    best = np.full((len(image), 0), -np.inf, np.float32)
    index = np.zeros((len(image), 0), np.int64)
    for start in range(0, len(features), _BLOCK):
        block = image.astype(np.float32) @ features[start:start + _BLOCK].T
        best = np.concatenate([best, block], axis=1)
        index = np.concatenate([index, np.broadcast_to(np.arange(start, start + block.shape[1]), block.shape)], 1)
        if best.shape[1] > CANDIDATES:
            keep = np.argpartition(-best, CANDIDATES - 1, axis=1)[:, :CANDIDATES]
            best, index = np.take_along_axis(best, keep, 1), np.take_along_axis(index, keep, 1)
    rows, columns = np.nonzero(best >= min_cosine)
    return {(int(row), int(index[row, column])) for row, column in zip(rows, columns, strict=True)}


@dataclass(frozen=True)
class Decontaminate:
    """Removes pool images that copy an image of ``sets``: candidates by hash (within ``bits``) or by embedding
    (``min_cosine``), confirmed by their pixels (``min_similarity``)."""

    sets: tuple[ImageSet, ...]
    model: EvalModel
    bits: int
    min_cosine: float
    min_similarity: float | None
    workers: int = 0
    reason: str = "decontaminated"
    setting: str = "decontaminate"

    def removed(self, pool: ScoredPool) -> str:
        import pyarrow as pa

        check_scoring_model(self.model, pool, "decontamination")
        reference = evaluation_images(self.sets, self.model, self.workers)
        connection = pool.connection
        connection.register(_REFERENCE, pa.table({
            "phash": pa.array(reference.hashes.reshape(-1), pa.uint64()),
            "evaluation": pa.array(np.repeat(np.arange(len(reference.hashes)), len(HASHED_AS)), pa.int64())}))
        pairs = within_bits(f"(SELECT phash, evaluation FROM {_REFERENCE})",
                            f"(SELECT shard, position, phash FROM {SCORES_VIEW})", self.bits,
                            select="b.shard, b.position, a.evaluation, bit_count(xor(a.phash, b.phash)) AS bits")
        connection.execute(f"""CREATE OR REPLACE TEMP TABLE {_HASH_CANDIDATES} AS SELECT * FROM (
                               SELECT shard, position, evaluation, min(bits) AS bits FROM ({pairs})
                               GROUP BY shard, position, evaluation) QUALIFY row_number() OVER (
                               PARTITION BY shard, position ORDER BY bits, evaluation) <= {CANDIDATES}""")
        matches: list[tuple[str, int, str, int, float, float | None]] = []
        for part in pool.index.parts:
            matches += self._part_matches(pool, part, reference)
        shard, position, evaluation, bits, cosine, similarity = zip(*matches, strict=True) if matches else [()] * 6
        connection.register("matched_pairs", pa.table({
            "shard": pa.array(shard, pa.string()), "position": pa.array(position, pa.int32()),
            "evaluation_image": pa.array(evaluation, pa.string()), "bits": pa.array(bits, pa.int32()),
            "cosine": pa.array(cosine, pa.float32()), "similarity": pa.array(similarity, pa.float32())}))
        connection.execute(f"""CREATE OR REPLACE TEMP TABLE {MATCHES} AS SELECT * FROM matched_pairs
                               QUALIFY row_number() OVER (PARTITION BY shard, position
                                                          ORDER BY similarity DESC NULLS LAST, cosine DESC) = 1""")
        connection.unregister("matched_pairs")
        connection.unregister(_REFERENCE)
        return f"""SELECT shard, position, 'copies ' || evaluation_image || ' (' || coalesce(printf('similarity %.3f, ',
                   similarity), 'unchecked, ') || printf('%d bits, cosine %.3f)', bits, cosine) AS evidence
                   FROM {MATCHES}"""

    def _part_matches(self, pool: ScoredPool, part: PartRecord, reference: EvaluationImages
                      ) -> list[tuple[str, int, str, int, float, float | None]]:
        """The candidate pairs of one part that are copies: (shard, position, evaluation image, bits, cosine,
        similarity)."""
        rows = read_part_rows(pool.scores, part, pool.index.embedding_width)
        if not len(rows.positions):
            return []
        place = {int(position): row for row, position in enumerate(rows.positions)}
        pairs = {(int(rows.positions[row]), evaluation)
                 for row, evaluation in _nearest_by_cosine(rows.image, reference.features, self.min_cosine)}
        pairs |= {(int(position), int(evaluation)) for position, evaluation in pool.connection.execute(
            f"SELECT position, evaluation FROM {_HASH_CANDIDATES} WHERE shard = ?", [part.name]).fetchall()}
        if not pairs:
            return []
        positions = sorted({position for position, _ in pairs})
        phash = dict(pool.connection.execute(
            f"SELECT position, phash FROM {SCORES_VIEW} WHERE shard = ? AND position IN "
            f"({', '.join(map(str, positions))})", [part.name]).fetchall())
        views = {} if self.min_similarity is None else {
            position: copy_view(Image.open(io.BytesIO(image)))
            for position, image in sample_images(pool, part.name, positions).items()}
        found = []
        for position, evaluation in sorted(pairs):
            similarity = (None if self.min_similarity is None
                          else copy_similarity(views[position], reference.views[evaluation]))
            if similarity is not None and similarity < self.min_similarity:
                continue
            cosine = float(rows.image[place[position]].astype(np.float32) @ reference.features[evaluation])
            bits = min((int(phash[position]) ^ int(each)).bit_count() for each in reference.hashes[evaluation])
            found.append((part.name, position, reference.names[evaluation], bits, cosine, similarity))
        return found
