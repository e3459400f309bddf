"""Near-duplicate images by perceptual hash: of images whose 64-bit hashes differ in at most ``bits`` bits, the one
with the highest image-text cosine is kept (ties by place in the pool), the others removed.

All pairs of a pool cannot be compared. Two hashes within ``bits`` of each other agree exactly on at least one of
``bits + 1`` disjoint bands of their bits (pigeonhole), so only pairs that share a band are compared, by an
equality join per band (multi-index hashing, Norouzi et al. 2012). Exact copies are grouped first, by hash, and
only each group's best image joins the bands: a hash shared by many images (a blank image, a logo) is one row
there, not a square of pairs. What remains quadratic is a band value shared by many *different* hashes; with 16
bits per band (``bits`` 3) a band value is shared by about rows / 65,536 hashes at random.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from cloob_core.curation.filters.score import RANKED
from cloob_core.curation.pool import SCORES_VIEW, ScoredPool


def bands(bits: int) -> list[tuple[int, int]]:
    """``bits + 1`` disjoint bands of the 64 bits, as (shift, width), as even as they divide."""
    count = bits + 1
    edges = [index * 64 // count for index in range(count + 1)]
    return [(start, end - start) for start, end in itertools.pairwise(edges)]


def within_bits(left: str, right: str, bits: int, also: str = "TRUE", select: str = "b.shard, b.position") -> str:
    """A query of ``select`` (by default ``b.shard, b.position``) for each pair of a row ``a`` of ``left`` and ``b``
    of ``right`` (tables or subqueries with a ``phash`` column) whose hashes differ in at most ``bits`` bits and
    which meet ``also``: one equality join per band, their union (a pair within ``bits`` shares a band)."""
    joins = []
    for shift, width in bands(bits):
        mask = (1 << width) - 1

        def band(side: str, shift: int = shift, mask: int = mask) -> str:
            return f"(({side}.phash >> {shift}) & {mask}::UBIGINT)"

        joins.append(f"""SELECT {select} FROM {left} a JOIN {right} b ON {band('a')} = {band('b')}
                         AND {also} WHERE bit_count(xor(a.phash, b.phash)) <= {bits}""")
    return " UNION ".join(joins)


@dataclass(frozen=True)
class NearDuplicates:
    """Removes each image that has a better-ranked image within ``bits`` bits of its perceptual hash."""

    bits: int
    reason: str = "near_duplicate"
    setting: str = "near_duplicates"

    def removed(self, pool: ScoredPool) -> str:
        # the ranks and each hash's best image are tables of their own: DuckDB 2.0.0 gave an empty join for the
        # same query with the ranking windows nested inside it
        pool.connection.execute(f"""CREATE OR REPLACE TEMP TABLE near_ranked AS SELECT s.shard, s.position, s.key,
                                    s.phash, r.score_rank FROM {SCORES_VIEW} s JOIN ({RANKED}) r
                                    USING (shard, position)""")
        pool.connection.execute("""CREATE OR REPLACE TEMP TABLE near_grouped AS SELECT *, row_number() OVER (
                                   PARTITION BY phash ORDER BY score_rank) AS place,
                                   first(key) OVER (PARTITION BY phash ORDER BY score_rank) AS head FROM near_ranked""")
        copies = "SELECT shard, position, 0 AS bits, head AS better FROM near_grouped WHERE place > 1"
        if self.bits:
            heads = "(SELECT phash, score_rank, shard, position, key FROM near_grouped WHERE place = 1)"
            near = within_bits(heads, heads, self.bits, "a.score_rank < b.score_rank",
                               select="b.shard, b.position, bit_count(xor(a.phash, b.phash)) AS bits, a.key AS better")
            copies = f"{copies} UNION ALL SELECT * FROM ({near})"
        return f"""SELECT shard, position, CASE WHEN bits = 0 THEN 'the same hash as ' || better
                   ELSE bits || ' bit(s) from ' || better END || ' (better scored)' AS evidence FROM ({copies})
                   QUALIFY row_number() OVER (PARTITION BY shard, position ORDER BY bits, better) = 1"""
