"""Filters on the image-text cosine: a fixed floor (LAION-5B's 0.28), and a global top fraction (DataComp's 30%)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cloob_core.curation.pool import SCORES_VIEW, ScoredPool

# the order of the global cut: the highest cosine first, a NaN cosine (a model that gave no direction) last, ties
# by place in the pool, so the same pool gives the same cut
RANKED = f"""SELECT shard, position, clip_score, row_number() OVER (ORDER BY isnan(clip_score), clip_score DESC,
shard, position) AS score_rank FROM {SCORES_VIEW}"""


@dataclass(frozen=True)
class ClipScoreFloor:
    """Removes samples whose image-text cosine is below ``floor`` (or not a number)."""

    floor: float
    reason: str = "min_clip_score"
    setting: str = "min_clip_score"

    def removed(self, pool: ScoredPool) -> str:
        return (f"SELECT shard, position, CASE WHEN isnan(clip_score) THEN 'clip_score NaN (no cosine)' ELSE "
                f"printf('clip_score %.4f < {self.floor!r}', clip_score) END AS evidence FROM {SCORES_VIEW} "
                f"WHERE isnan(clip_score) OR clip_score < {self.floor!r}")


@dataclass(frozen=True)
class TopFraction:
    """Removes all but the ``fraction`` of the pool with the highest cosine: ``ceil(fraction x rows)`` kept, over
    every part at once. The engine sorts out of core (DuckDB spills past its memory limit)."""

    fraction: float
    reason: str = "top_fraction"
    setting: str = "top_fraction"

    def kept(self, rows: int) -> int:
        return min(rows, math.ceil(self.fraction * rows))

    def removed(self, pool: ScoredPool) -> str:
        kept = self.kept(pool.rows)
        return (f"SELECT shard, position, printf('clip_score %.4f: rank %,d of {pool.rows:,}, below the top {kept:,}', "
                f"clip_score, score_rank) AS evidence FROM ({RANKED}) WHERE score_rank > {kept}")
