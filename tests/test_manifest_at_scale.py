"""The data path as the cluster runs it: a manifest of parts on S3, a partition that reads only the row groups of its
own shards, and an incremental run that builds only a new part's shards."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from image_server import ImageServer

from cloob_core import storage
from cloob_core.config import load_config
from cloob_core.data.acquire import acquire
from cloob_core.data.download import download
from cloob_core.data.manifest import Partition
from cloob_core.data.run_manifest import RunManifest
from cloob_core.data.writer import read_records


def _parts(rows: int, parts: int, url) -> list[pa.Table]:
    per = rows // parts
    return [pa.table({"url": [url(i) for i in range(p * per, (p + 1) * per)],
                      "caption": [f"photo number {i}" for i in range(p * per, (p + 1) * per)],
                      "score": [i / rows for i in range(p * per, (p + 1) * per)]}) for p in range(parts)]


@pytest.fixture
def row_groups_read(monkeypatch) -> list[tuple[str, tuple[int, ...]]]:
    """Every read of row groups from a part: (the part's file, the groups)."""
    reads: list[tuple[str, tuple[int, ...]]] = []
    original = pq.ParquetFile.read_row_groups

    def recording(self, row_groups, *args, **kwargs):
        reads.append((getattr(self.reader, "_source_name", "?"), tuple(row_groups)))
        return original(self, row_groups, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_groups", recording)
    return reads


def test_a_partition_reads_only_the_row_groups_of_its_own_shards(s3_bucket, row_groups_read, monkeypatch):
    source = f"s3://{s3_bucket}/crawl"
    for index, table in enumerate(_parts(200_000, 10, lambda i: f"http://127.0.0.1:9/{i}.jpg")):
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        storage.write_bytes(f"{source}/part-{index:05d}.parquet", sink.getvalue().to_pybytes())
    storage.write_bytes(f"{source}/_SUCCESS", b"")  # what Spark leaves beside its parts: not a part
    config = load_config(overrides=[f"acquire.source={source}", "preprocess.shard_size=1000",
                                    "download.processes=1", "download.retries=0",
                                    "validation.min_success_ratio=0"])  # its URLs go nowhere, by design
    acquired = acquire(config, f"s3://{s3_bucket}/manifest")
    manifest = RunManifest.open(acquired.manifest)
    assert (acquired.rows, acquired.parts) == (200_000, 10)
    assert all(part.row_groups == (2000,) * 10 for part in manifest.parts)  # groups of whole shards
    assert manifest.shard_count(1000) == 200

    opened: list[str] = []
    seekable = storage.open_seekable
    monkeypatch.setattr(storage, "open_seekable", lambda location, *a, **k: opened.append(location) or
                        seekable(location, *a, **k))
    output = f"s3://{s3_bucket}/shards"
    result = download(acquired.manifest, output, config, partition=Partition(3, 50), progress=False)

    assert result.shards_done == 4  # 3/50 of 200 shards: shards 12 to 15, rows 12,000 to 15,999
    # ... which lie in part 0, row groups 6 and 7 (of 2,000 rows each), each read once
    assert [groups for _, groups in row_groups_read] == [(6,), (7,)]
    parts_opened = {location.rsplit("/", 1)[1] for location in opened if "/part-" in location}
    assert parts_opened == {manifest.parts[0].name}
    assert [r.name for r in read_records(output)] == ["00012", "00013", "00014", "00015"]
    assert result.summary.stats["rows"] == 4000 and result.summary.stats["failures_by_reason"] == {
        "blocked_address": 4000}


def test_an_incremental_run_builds_only_the_new_parts_shards(tmp_path):
    source = tmp_path / "crawl"
    source.mkdir()
    with ImageServer() as server:
        tables = _parts(30, 3, lambda i: server.url(f"/img/{i}.jpg"))
        for index, table in enumerate(tables[:2]):
            pq.write_table(table, source / f"part-{index:05d}.parquet")
        config = load_config(overrides=[f"acquire.source={source}", "preprocess.shard_size=4",
                                        "preprocess.image_size=32", "download.allow_private_network=true",
                                        "download.processes=1", "validation.min_success_ratio=0"])
        first = download(acquire(config, str(tmp_path / "manifest")).manifest, str(tmp_path / "shards"), config,
                         progress=False)
        assert first.shards_done == 6 and sum(server.hits.values()) == 20  # 3 shards of 4, 4, 2 rows per part
        before = {p.name: p.read_bytes() for p in (tmp_path / "shards").glob("*.tar")}

        pq.write_table(tables[2], source / "part-00002.parquet")  # the crawl grew
        again = acquire(config, str(tmp_path / "manifest"))
        assert (again.parts, again.parts_reused) == (3, 2)
        second = download(again.manifest, str(tmp_path / "shards"), config, progress=False)

    assert (second.shards_done, second.shards_skipped) == (3, 6)
    assert sum(server.hits.values()) == 30  # only the new part's 10 rows were fetched
    assert {p.name: p.read_bytes() for p in (tmp_path / "shards").glob("*.tar") if p.name in before} == before
    assert second.summary.stats["successes"] == 30 and second.summary.stats["missing_shards"] == 0


def test_a_changed_earlier_part_is_refused_by_the_folder_it_would_corrupt(tmp_path, capsys):
    from cloob_core.cli import main

    source = tmp_path / "crawl"
    source.mkdir()
    tables = _parts(8, 2, lambda i: f"http://127.0.0.1:9/{i}.jpg")
    for index, table in enumerate(tables):
        pq.write_table(table, source / f"part-{index:05d}.parquet")
    args = ["--source", str(source), "--output", str(tmp_path / "manifest")]
    assert main(["data", "acquire", *args]) == 0
    build = ["data", "download", "--manifest", str(tmp_path / "manifest"), "--output", str(tmp_path / "shards"),
             "--no-progress", "--retries", "0", "--set", "validation.min_success_ratio=0"]
    assert main(build) == 0
    pq.write_table(tables[1].slice(0, 3), source / "part-00000.parquet")  # rewritten in place
    assert main(["data", "acquire", *args]) == 0
    capsys.readouterr()
    assert main(build) == 2
    assert "manifest: part 0 is 3 rows" in capsys.readouterr().err
