"""What the filters keep of a scored pool: every filter's removals gathered in the engine, the kept table (every
sample by key, kept or not, with each reason that removed it), and the counts a report gives: removed by each
filter, by each pair of filters, and kept."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cloob_core.curation.filters import Filter
from cloob_core.curation.pool import SCORES_VIEW, ScoredPool
from cloob_core.io import DiskFull

REMOVED_TABLE = "removed"


@dataclass(frozen=True)
class Selection:
    """The filters' outcome over ``rows`` samples."""

    rows: int
    kept: int
    removed_by: dict[str, int]  # reason -> samples it removed (a sample removed by two filters counts in both)
    overlaps: dict[tuple[str, str], int]  # (reason, reason) in order -> samples both removed
    settings: dict[str, str]  # reason -> the curation setting of the filter that gives it

    @property
    def removed(self) -> int:
        return self.rows - self.kept

    def most_removing(self) -> str | None:
        """The filter that removed the most (ties: the first in name order), or None where nothing was removed."""
        return max(sorted(self.removed_by), key=lambda reason: self.removed_by[reason], default=None)


def select(pool: ScoredPool, filters: list[Filter]) -> Selection:
    """Apply ``filters`` to the pool; the removals stay in the connection's ``removed`` table for what follows."""
    connection = pool.connection
    connection.execute(f"""CREATE OR REPLACE TABLE {REMOVED_TABLE} (shard VARCHAR, position INTEGER, reason VARCHAR,
                           evidence VARCHAR)""")
    for chosen in filters:
        connection.execute(f"""INSERT INTO {REMOVED_TABLE} SELECT shard, position, '{chosen.reason}', min(evidence)
                               FROM ({chosen.removed(pool)}) GROUP BY shard, position""")
    removed_by = {reason: 0 for reason in sorted(f.reason for f in filters)}
    removed_by |= dict(connection.execute(f"SELECT reason, count(*) FROM {REMOVED_TABLE} GROUP BY reason").fetchall())
    overlaps = {(a, b): count for a, b, count in connection.execute(
        f"""SELECT a.reason, b.reason, count(*) FROM {REMOVED_TABLE} a JOIN {REMOVED_TABLE} b USING (shard, position)
            WHERE a.reason < b.reason GROUP BY ALL ORDER BY ALL""").fetchall()}
    (removed,) = connection.execute(
        f"SELECT count(*) FROM (SELECT DISTINCT shard, position FROM {REMOVED_TABLE})").fetchone()
    return Selection(pool.rows, pool.rows - removed, removed_by, overlaps,
                     {chosen.reason: chosen.setting for chosen in filters})


KEPT_QUERY = f"""SELECT s.key, s.shard, s.position, r.reasons IS NULL AS kept,
                 coalesce(r.reasons, []::VARCHAR[]) AS reasons, coalesce(r.evidence, []::VARCHAR[]) AS evidence,
                 s.clip_score
                 FROM {SCORES_VIEW} s LEFT JOIN (
                     SELECT shard, position, list(reason ORDER BY reason) AS reasons,
                            list(evidence ORDER BY reason) AS evidence FROM {REMOVED_TABLE} GROUP BY shard, position
                 ) r USING (shard, position)
                 ORDER BY s.key, s.shard, s.position"""


def write_kept_table(pool: ScoredPool, path: Path) -> None:
    """The kept table as parquet: every sample sorted by key (then shard and position), whether it was kept, the
    reasons that removed it (none for a kept one), each reason's evidence (in the same order) and its score.
    Written by the engine, out of core."""
    import duckdb

    target = str(path).replace("'", "''")
    try:
        pool.connection.execute(f"COPY ({KEPT_QUERY}) TO '{target}' (FORMAT parquet, COMPRESSION zstd)")
    except duckdb.IOException as err:  # DuckDB's own error for a write the disk refused, not an OSError
        if "No space left on device" in str(err):
            raise DiskFull(f"no space left on device writing {path}") from None
        raise
