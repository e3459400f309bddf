"""The data path at scale: peak memory and wall time of each manifest step as the manifest grows.

For each size, generates a folder of parquet parts (URLs of about 60 characters on a loopback port that refuses
connections, captions of about 35, two numeric columns as LAION's metadata has, 1% of URLs repeated), then runs,
each in its own process:
- `cloob data acquire` of the folder (streamed into the run manifest; URL duplicates by DuckDB);
- `cloob data validate --manifest` (exact counts by DuckDB, row-level expectations on the sample);
- the plan of partition 0 of 1,000 (index → its shards), as the download runs it;
- `cloob data download --partition 0/1000` (its shards only; every URL refused, so nothing is fetched).
Prints each step's wall time and peak RSS (the step's process, and its largest worker), and the ratio of the
largest size's peak to the smallest's: flat is ~1.

    python benchmarks/bench_manifest.py [--rows 1000000,10000000,50000000] [--parts 10] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEASURE = """
import json, resource, runpy, sys
sys.argv = sys.argv[1:]
code = 0
try:
    if sys.argv[0].endswith(".py"):
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    code = stop.code or 0
usage = lambda who: resource.getrusage(who).ru_maxrss * 1024
print(json.dumps({"rss": usage(resource.RUSAGE_SELF), "workers": usage(resource.RUSAGE_CHILDREN), "code": code}),
      file=sys.stderr)
"""
PLAN = """
import sys
from cloob_core.config import CloobConfig
from cloob_core.data.manifest import Partition
from cloob_core.data.plan import plan_round, settings_of
from cloob_core.data.run_manifest import RunManifest
from cloob_core.data.writer import read_records
config = CloobConfig.model_validate({"preprocess": {"shard_size": 256}})
manifest = RunManifest.open(sys.argv[1])
settings_of(manifest, config)
owned = Partition(0, 1000).shards(manifest.shard_count(256))
plan = plan_round(manifest, sys.argv[2], read_records(sys.argv[2], owned.__contains__), owned, 0,
                  256)
print(f"partition 0/1000: {len(plan)} shards, {sum(len(rows) for _, _, rows in plan)} rows")
"""


def generate(folder: Path, rows: int, parts: int, seed: int = 0) -> None:
    """``rows`` rows in ``parts`` parquet files, written a million rows at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    per_part = -(-rows // parts)
    for part in range(parts):
        start, stop = part * per_part, min(rows, (part + 1) * per_part)
        with pq.ParquetWriter(folder / f"part-{part:05d}.parquet", pa.schema(
                [("url", pa.string()), ("caption", pa.string()), ("similarity", pa.float32()),
                 ("width", pa.int32())])) as writer:
            for first in range(start, stop, 1_000_000):
                ids = np.arange(first, min(stop, first + 1_000_000))
                repeated = rng.random(len(ids)) < 0.01
                ids = np.where(repeated, rng.integers(0, max(1, first + 1), len(ids)), ids)
                text = pa.array(ids).cast(pa.string())
                url = pc.binary_join_element_wise("http://127.0.0.1:9/images/crawl-2026/photo-", text,
                                                  "-large.jpg", "")
                caption = pc.binary_join_element_wise("a photograph of item number ", text, " in a room", "")
                writer.write_table(pa.table({
                    "url": url, "caption": caption,
                    "similarity": pa.array(rng.random(len(ids), dtype=np.float32)),
                    "width": pa.array(rng.integers(64, 4096, len(ids), dtype=np.int32))}))


def measure(args: list[str], cwd: Path) -> dict:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", MEASURE, *args], cwd=cwd, capture_output=True, text=True)
    wall = time.monotonic() - started
    lines = done.stderr.strip().splitlines()
    facts = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"rss": 0, "workers": 0, "code": -1}
    if facts["code"] not in (0, None):
        print(f"  {' '.join(args[:3])} exited {facts['code']}: {' | '.join(lines[-3:-1])}", file=sys.stderr)
    return {"wall": wall, **facts}


def run_size(work: Path, rows: int, parts: int) -> dict[str, dict]:
    source, manifest, shards = work / f"source-{rows}", work / f"manifest-{rows}", work / f"shards-{rows}"
    started = time.monotonic()
    # in a process of its own: a child's peak RSS starts at its parent's (Linux keeps ru_maxrss across exec), so
    # the parent that measures must stay small
    subprocess.run([sys.executable, __file__, "--generate", str(source), str(rows), str(parts)], check=True)
    print(f"{rows:,} rows: generated {parts} parts in {time.monotonic() - started:.0f} s "
          f"({sum(p.stat().st_size for p in source.iterdir()) / 2**20:.0f} MiB)", flush=True)
    params = work / "params.yaml"
    params.write_text(json.dumps({"preprocess": {"shard_size": 256}, "download": {"processes": 1, "threads": 8},
                                  "validation": {"max_bad_row_fraction": 0.02}}))  # the 1% of repeated URLs
    cli = ["cloob_core.cli"]
    steps = {
        "acquire": [*cli, "data", "acquire", "--params", str(params), "--source", str(source), "--output",
                    str(manifest)],
        "manifest gate": [*cli, "data", "validate", "--params", str(params), "--manifest", str(manifest)],
        "plan (partition 0/1000)": [str(work / "plan_partition.py"), str(manifest), str(shards)],
        "download partition 0/1000": [*cli, "data", "download", "--params", str(params), "--manifest", str(manifest),
                                      "--output", str(shards), "--partition", "0/1000", "--no-progress"],
    }
    (work / "plan_partition.py").write_text(PLAN)
    results = {}
    for name, args in steps.items():
        results[name] = measure(args, ROOT)
        print(f"  {name:<28} {results[name]['wall']:8.1f} s  {results[name]['rss'] / 2**20:8.0f} MB"
              f"  (largest worker {results[name]['workers'] / 2**20:.0f} MB)", flush=True)
    shutil.rmtree(source)
    shutil.rmtree(shards, ignore_errors=True)
    shutil.rmtree(manifest, ignore_errors=True)
    return results


def _peak(result: dict) -> int:
    """The step's peak: its own process or its largest worker, whichever is larger."""
    return max(result["rss"], result["workers"])


def main() -> None:
    if sys.argv[1:2] == ["--generate"]:
        folder, rows, parts = sys.argv[2:5]
        generate(Path(folder), int(rows), int(parts))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000000,10000000,50000000")
    parser.add_argument("--parts", type=int, default=10)
    parser.add_argument("--workdir", default=None, help="where the manifests go (default: a temporary folder)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.rows.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-manifest-"))
    work.mkdir(parents=True, exist_ok=True)
    table = {rows: run_size(work, rows, args.parts) for rows in sizes}
    steps = list(next(iter(table.values())))
    print("\n| step | " + " | ".join(f"{rows:,} rows: wall, peak RSS" for rows in sizes) + " | RSS ratio |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for step in steps:
        cells = [f"{table[rows][step]['wall']:.1f} s, {_peak(table[rows][step]) / 2**20:.0f} MB" for rows in sizes]
        ratio = _peak(table[sizes[-1]][step]) / max(1, _peak(table[sizes[0]][step]))
        print(f"| {step} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
