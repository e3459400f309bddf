"""The global top-fraction cut (`curation.top_fraction`) over synthetic score rows: ours, the query `cloob data
curate` runs (the engine, DuckDB, sorting out of core within `engine.memory_limit`), against the anchor, DataComp's
way (`apply_filter.py`: every part's scores loaded into memory, the threshold by `np.quantile`). Each runs in a
process of its own; its wall time and peak RSS (the process's own, from `wait4`) are printed with the ratios.

    python benchmarks/bench_top_fraction.py [--rows 100000000] [--parts 100] [--fraction 0.3] [--folder DIR]

The pool is written once into ``--folder`` (default: a folder under the system's temporary one, kept for a second
run; about 1 GB at 10^8 rows): score parts in the layout `cloob data score` writes, with every column of the
score table, cosines drawn from N(0.25, 0.05) and rounded to 10^-4, so that ties cross the cut, and shards that
are placeholders of distinct sizes (the cut reads no shard). The two cuts must agree on the number kept up to
the ties at the threshold (ours keeps exactly ceil(fraction x rows); the anchor every score at or above its
quantile).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from cloob_core.curation.score_table import (
    FACTS,
    INDEX_FILE,
    ModelStamp,
    PartRecord,
    ScoreIndex,
    part_file,
    read_index,
    schema,
    write_index,
    write_part,
)
from cloob_core.data.shard_files import shard_list, shards_fingerprint

STAMP = ModelStamp("synthetic", "none", "fp32")


def _part_table(index: int, name: str, rows: int, rng: np.random.Generator):
    import pyarrow as pa

    def repeated(text: str) -> pa.Array:
        return pa.array([text], pa.string()).take(np.zeros(rows, np.int64))

    scores = np.round(rng.normal(0.25, 0.05, rows), 4).astype(np.float32)
    columns = {
        "key": pa.array(np.arange(rows, dtype=np.int64) + index * 10**10).cast(pa.string()),
        "shard": repeated(name), "position": pa.array(np.arange(rows, dtype=np.int32)),
        "url": pa.nulls(rows, pa.string()), "caption": repeated(""), "sha256": repeated(""),
        "clip_score": pa.array(scores),
        "caption_words": pa.array(np.full(rows, 5, np.int32)), "caption_chars": pa.array(np.full(rows, 30, np.int32)),
        "language": repeated("en"),
        "language_confidence": pa.array(np.ones(rows, np.float32)),
        "phash": pa.array(rng.integers(0, 2**63, rows, dtype=np.uint64)),
        "width": pa.array(np.full(rows, 256, np.int32)), "height": pa.array(np.full(rows, 256, np.int32)),
    }
    return pa.Table.from_pydict(columns, schema=schema())


def make_pool(folder: Path, rows: int, parts: int) -> tuple[str, str]:
    """The pool's placeholder shards and its scores (reused when the folder holds this many rows already)."""
    shards, scores = folder / "shards", folder / "scores"
    if (scores / INDEX_FILE).exists() and read_index(str(scores)).rows == rows:
        return str(shards), str(scores)
    shards.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    records, sizes = [], {}
    for index in range(parts):
        name = f"{index:05d}"
        count = rows // parts + (index < rows % parts)
        (shards / f"{name}.tar").write_bytes(b"\0" * (index + 1))  # distinct sizes: the pool's fingerprint
        sizes[f"{name}.tar"] = count
        empty = np.zeros((count, 0), np.float16)
        records.append(write_part(str(scores), partial(PartRecord, name, index + 1, None, count, 0, 0, STAMP,
                                                                    facts=FACTS),
                                  _part_table(index, name, count, rng), empty, empty))
        print(f"\rwrote part {index + 1}/{parts}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    (shards / "sizes.json").write_text(json.dumps(sizes))
    write_index(str(scores), ScoreIndex(STAMP, shards_fingerprint(shard_list(str(shards))[0]), 0, records))
    return str(shards), str(scores)


def run_ours(shards: str, scores: str, fraction: float) -> dict[str, float]:
    """What `cloob data curate` does with only curation.top_fraction set: the pool opened (each part's digest
    checked), the cut computed by the engine into its ``removed`` table."""
    from cloob_core.config import EngineConfig
    from cloob_core.curation.filters.score import TopFraction
    from cloob_core.curation.pool import open_pool
    from cloob_core.curation.selection import select
    from cloob_core.data.engine import connect

    started = time.perf_counter()
    with connect(EngineConfig()) as connection:
        selection = select(open_pool(shards, scores, connection), [TopFraction(fraction)])
    return {"seconds": time.perf_counter() - started, "kept": selection.kept}


def run_anchor(scores: str, fraction: float) -> dict[str, float]:
    """DataComp's apply_filter.py: every part's cosine column in memory, the threshold at the quantile."""
    import pyarrow.parquet as pq

    started = time.perf_counter()
    index = read_index(scores)
    column = np.concatenate([pq.read_table(part_file(scores, part.name, ".parquet"), columns=["clip_score"])
                             .column("clip_score").to_numpy() for part in index.parts])
    threshold = np.quantile(column, 1 - fraction, method="lower")
    return {"seconds": time.perf_counter() - started, "kept": int((column >= threshold).sum())}


def _measured(*arguments: str) -> tuple[dict[str, float], float]:
    """A run of this script in a process of its own: its result and its peak RSS in GB."""
    process = subprocess.Popen([sys.executable, __file__, *arguments], stdout=subprocess.PIPE, text=True)
    output = process.stdout.read() if process.stdout else ""
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(arguments)} exited {process.returncode}")
    return json.loads(output), usage.ru_maxrss / 1024**2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=float, default=1e8)
    parser.add_argument("--parts", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "cloob-bench-top-fraction")
    parser.add_argument("--run", choices=("ours", "anchor"), help=argparse.SUPPRESS)  # a measured child
    args = parser.parse_args()
    shards, scores = str(args.folder / "shards"), str(args.folder / "scores")
    if args.run:
        result = run_ours(shards, scores, args.fraction) if args.run == "ours" else run_anchor(scores, args.fraction)
        print(json.dumps(result))
        return
    rows = int(args.rows)
    started = time.perf_counter()
    make_pool(args.folder, rows, args.parts)
    print(f"pool: {rows:,} score rows in {args.parts} parts ({time.perf_counter() - started:.0f} s to write or "
          f"find); top_fraction {args.fraction}, engine.memory_limit 512MB (the default); {os.cpu_count()} cores")
    common = ["--folder", str(args.folder), "--fraction", str(args.fraction)]
    ours, ours_gb = _measured("--run", "ours", *common)
    anchor, anchor_gb = _measured("--run", "anchor", *common)
    expected = math.ceil(args.fraction * rows)
    print(f"{'':24}{'seconds':>10}{'peak RSS':>12}{'kept':>14}")
    print(f"{'ours (DuckDB, sorted)':24}{ours['seconds']:>10.1f}{ours_gb:>10.2f} GB{int(ours['kept']):>14,}")
    print(f"{'anchor (numpy quantile)':24}{anchor['seconds']:>10.1f}{anchor_gb:>10.2f} GB{int(anchor['kept']):>14,}")
    print(f"ours / anchor: time {ours['seconds'] / anchor['seconds']:.2f}x, peak RSS {ours_gb / anchor_gb:.2f}x; "
          f"ours kept exactly ceil({args.fraction} x rows) = {expected:,}: {int(ours['kept']) == expected}; the "
          f"anchor {int(anchor['kept']) - expected:+,} (the ties at its threshold)")


if __name__ == "__main__":
    main()
