"""How well the scoring model tells this pool's captions from other captions: the ROC AUC of each sample's
image-text cosine (its ``clip_score``) against the cosine of its image with another sample's caption, from the
embeddings scoring stored. 0.5 is chance: a scorer at chance cuts at random, however ordinary its histogram looks.

The other caption comes from another part (the parts in a seeded order, each part's images against the next part's
captions, cycled to its length), not from the same shard, whose captions a crawl often keeps in site or category
order: near-duplicates as negatives would understate the separation. A pool of one part pairs each image with a
caption of that part, a seeded rotation away. The AUC is computed from two histograms of 4,000 bins over [-1, 1]
(a bin's ties count half), so memory stays flat in the pool's rows; two parts' embeddings are read at a time, and
the parts are read in their seeded order until 200,000 pairs are counted (an AUC's standard error is then under
0.002), so a large pool costs no more than a part or two of reading per 200,000 samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cloob_core.curation.pool import ScoredPool
from cloob_core.curation.score_table import PartRows, read_part_rows

BINS = 4_000
MAX_PAIRS = 200_000
CHANCE_BAND = 0.1  # an AUC within this of 0.5 is "near chance" in the report's words


@dataclass(frozen=True)
class Separation:
    """The scorer's separation on a pool: ``auc`` (None where the pool has fewer than two samples), the mean
    cosine of matched and of mismatched pairs, and the number of pairs of each."""

    auc: float | None
    matched_mean: float | None
    mismatched_mean: float | None
    pairs: int

    @property
    def near_chance(self) -> bool:
        return self.auc is not None and self.auc < 0.5 + CHANCE_BAND

    def line(self) -> str:
        if self.auc is None:
            return "scorer separation: not measured (fewer than two scored samples)"
        return (f"scorer separation on this pool: AUC {self.auc:.3f} (matched captions against another sample's, "
                f"{self.pairs:,} pairs; mean cosine {self.matched_mean:.3f} against {self.mismatched_mean:.3f}; 0.5 "
                f"is chance){': near chance, so a score-based cut is close to random' if self.near_chance else ''}")

    def as_dict(self) -> dict[str, float | int | None]:
        return {"auc": self.auc, "matched_mean": self.matched_mean, "mismatched_mean": self.mismatched_mean,
                "pairs": self.pairs}


def _cosines(images: np.ndarray, texts: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", images.astype(np.float32), texts.astype(np.float32))


def _cycled(texts: np.ndarray, rows: int, offset: int) -> np.ndarray:
    return texts[(np.arange(rows) + offset) % len(texts)]


def _histogram(values: np.ndarray) -> np.ndarray:
    return np.histogram(np.clip(values, -1.0, 1.0), bins=BINS, range=(-1.0, 1.0))[0].astype(np.int64)


def auc_of_histograms(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a positive scores above a negative), ties within a bin counted half, from two histograms on one grid."""
    below = np.concatenate([[0], np.cumsum(negative)[:-1]])
    return float((positive * (below + 0.5 * negative)).sum() / (positive.sum() * negative.sum()))


def scorer_separation(pool: ScoredPool, seed: int) -> Separation:
    """The scoring model's separation of matched from mismatched captions on ``pool`` (module docstring)."""
    rng = np.random.default_rng(seed)
    parts = [part for part in pool.index.parts if part.rows]
    order = [parts[i] for i in rng.permutation(len(parts))]
    width = pool.index.embedding_width
    matched, mismatched = np.zeros(BINS, np.int64), np.zeros(BINS, np.int64)
    sums = [0.0, 0.0]
    if sum(part.rows for part in order) < 2:
        return Separation(None, None, None, 0)

    def add(rows: PartRows, texts: np.ndarray, offset: int) -> None:
        same = rows.clip_scores.astype(np.float32)
        other = _cosines(rows.image, _cycled(texts, len(same), offset))
        matched[:] += _histogram(same)
        mismatched[:] += _histogram(other)
        sums[0] += float(same.sum())
        sums[1] += float(other.sum())

    first = read_part_rows(pool.scores, order[0], width)
    if len(order) == 1:
        add(first, first.text, int(rng.integers(1, len(first.positions))))
    else:
        previous = first
        for part in order[1:]:
            current = read_part_rows(pool.scores, part, width)
            add(previous, current.text, int(rng.integers(0, len(current.positions))))
            previous = current
            if matched.sum() >= MAX_PAIRS:
                break
        add(previous, first.text, int(rng.integers(0, len(first.positions))))
    pairs = int(matched.sum())
    return Separation(auc_of_histograms(matched, mismatched), sums[0] / pairs, sums[1] / pairs, pairs)
