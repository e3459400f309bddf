"""`cloob data download` against a real HTTP server on 127.0.0.1 that misbehaves in every listed way."""

from __future__ import annotations

import csv
import json
import tarfile
import time
from pathlib import Path

import pytest
from image_server import ImageServer, photo_bytes

from cloob_core.cli import main
from cloob_core.config import load_config
from cloob_core.data.download import download
from cloob_core.data.manifest import Partition

FAST = [
    "validation.min_success_ratio=0",  # these runs fail rows on purpose: they test what is recorded
    "download.allow_private_network=true",
    "download.connect_timeout=1",
    "download.read_timeout=1",
    "download.url_deadline=3",
    "download.retries=2",
    "download.backoff=0.05",
    "download.max_bytes=2097152",
    "download.processes=2",
    "download.threads=8",
    "preprocess.image_size=64",
]

MISBEHAVING = {  # path → the reason its row must be recorded with (None: it must be stored)
    "/404": "http_404",
    "/403": "http_403",
    "/flaky/1": None,
    "/stall": "timeout",
    "/drip": "deadline_exceeded",
    "/drip-headers": "deadline_exceeded",
    "/truncated": "truncated",
    "/corrupt.jpg": "decode_error",
    "/bomb.png": "decompression_bomb",
    "/html": "not_an_image",
    "/loop": "too_many_redirects",
    "/redirect/7": None,
    "/optout.jpg": "opted_out",
    "/optout-other.jpg": None,
    "/reset": "connection_error",
    "/huge": "too_large",
    "/alpha.png": None,
    "/png/8": None,
}


def write_manifest(path: Path, rows: list[tuple[str, str]], extra: bool = True) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["url", "caption", "source"] if extra else ["url", "caption"])
        for index, (url, caption) in enumerate(rows):
            writer.writerow([url, caption, f"row-{index}"] if extra else [url, caption])
    return path


def tar_members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.fixture(scope="module")
def misbehaving_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misbehaving")
    with ImageServer() as server:
        rows = [(server.url(f"/img/{i}.jpg"), f"a photo number {i}") for i in range(6)]
        rows += [(server.url(path), f"route {path}") for path in MISBEHAVING]
        rows += [
            (server.url("/img/2.jpg"), "the same URL again"),  # duplicate URL: fetched once
            (server.url("/img/3.jpg?copy=1"), "other URL, same bytes"),  # duplicate content
            (server.url("/img/40.jpg"), ""),  # empty caption
            ("ftp://127.0.0.1/x.jpg", "not http"),
            ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
        ]
        manifest = write_manifest(tmp / "manifest.csv", rows)
        config = load_config(overrides=[*FAST, "preprocess.shard_size=8"])
        started = time.monotonic()
        result = download(str(manifest), str(tmp / "out"), config, progress=False)
        elapsed = time.monotonic() - started
        hits = dict(server.hits)
        assert len(server.user_agents) == 1 and next(iter(server.user_agents)).startswith("cloob-pipelines/")
    return tmp / "out", rows, result, elapsed, hits


def test_every_misbehaviour_is_recorded_with_its_reason(misbehaving_run):
    out, rows, result, _, _ = misbehaving_run
    failures = {f["url"]: f for f in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}
    for path, reason in MISBEHAVING.items():
        url = next(u for u, _ in rows if u.endswith(path))
        if reason is None:
            assert url not in failures, f"{path} should be stored, failed with {failures.get(url)}"
        else:
            assert failures[url]["reason"] == reason, f"{path}: {failures[url]}"
    by_caption = {caption: failures.get(url) for url, caption in rows}
    assert by_caption["the same URL again"]["reason"] == "duplicate_url"
    assert by_caption["other URL, same bytes"]["reason"] == "duplicate_content"
    assert by_caption[""]["reason"] == "empty_caption"
    assert by_caption["not http"]["reason"] == "unsupported_scheme"
    assert by_caption["cloud metadata"]["reason"] == "blocked_address"
    assert result.summary.stats["failures"] == len(failures)


def test_stored_samples_have_image_caption_and_metadata(misbehaving_run):
    out, rows, result, _, _ = misbehaving_run
    sizes = json.loads((out / "sizes.json").read_text())
    members: dict[str, bytes] = {}
    for name, count in sizes.items():
        tar = tar_members(out / name)
        assert len(tar) == 3 * count
        members.update(tar)
    stored = sorted({name.split(".")[0] for name in members})
    assert len(stored) == 6 + sum(reason is None for reason in MISBEHAVING.values())
    assert sum(sizes.values()) == result.summary.stats["successes"] == len(stored)
    meta = json.loads(members["000000001.json"])
    assert meta["key"] == "000000001" and meta["url"] == rows[1][0] and meta["caption"] == rows[1][1]
    assert meta["source"] == "row-1"  # extra manifest columns are carried
    original = photo_bytes(1)
    import hashlib

    assert meta["sha256"] == hashlib.sha256(original).hexdigest()
    assert (meta["original_width"], meta["original_height"]) == (213, 161)
    assert min(meta["width"], meta["height"]) == 64  # keep_ratio: shorter side to image_size
    assert members["000000001.txt"].decode() == rows[1][1]
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(members["000000001.jpg"]))
    assert image.format == "JPEG" and image.mode == "RGB" and image.size == (meta["width"], meta["height"])


def test_transient_errors_are_retried_permanent_ones_are_not(misbehaving_run):
    *_, hits = misbehaving_run
    assert hits["/flaky/1"] == 2  # 500, then 200
    assert hits["/404"] == 1 and hits["/403"] == 1 and hits["/corrupt.jpg"] == 1
    assert hits["/img/2.jpg"] == 1  # the repeated URL was fetched once


def test_finishes_in_bounded_time_despite_stalls(misbehaving_run):
    *_, elapsed, _ = misbehaving_run
    # /stall and /drip would hold a naive client for 30-60 s; the deadline is 3 s per URL (+ read timeout).
    assert elapsed < 25


def test_per_shard_records_and_totals(misbehaving_run):
    out, rows, _result, _, _ = misbehaving_run
    stats = json.loads((out / "stats.json").read_text())
    assert stats["rows"] == len(rows)
    assert stats["successes"] + stats["failures"] == len(rows)
    shard_stats = [json.loads(p.read_text()) for p in sorted(out.glob("*_stats.json"))]
    assert len(shard_stats) == -(-len(rows) // 8)
    assert sum(s["rows"] for s in shard_stats) == len(rows)
    assert all("failures_by_reason" in s and "duration_s" not in s for s in shard_stats)  # reproducible records
    assert stats["duplicates_dropped"] == {"duplicate_content": 1, "duplicate_url": 1}
    assert [path.name for path in out.glob(".*")] == [".cloob-unit.json"]  # the summary's record; nothing staged


def test_rerun_resumes_without_refetching(misbehaving_run, tmp_path):
    out, *_ = misbehaving_run
    before = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    config = load_config(overrides=[*FAST, "preprocess.shard_size=8"])
    manifest = out.parent / "manifest.csv"
    result = download(str(manifest), str(out), config, progress=False)
    assert result.shards_done == 0 and result.shards_skipped == len(list(out.glob("*_stats.json")))
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == before


def test_retry_failed_reattempts_only_failed_rows(tmp_path):
    with ImageServer(down_times=3) as server:  # /down/N answers 503 three times: more than retries=1 allows
        rows = [(server.url(f"/img/{i}.jpg"), f"photo {i}") for i in range(4)]
        rows += [(server.url(f"/down/{i}"), f"down {i}") for i in range(2)] + [(server.url("/404"), "gone")]
        manifest = write_manifest(tmp_path / "m.csv", rows)
        config = load_config(overrides=[*FAST, "download.retries=1", "preprocess.shard_size=5"])
        first = download(str(manifest), str(tmp_path / "out"), config, progress=False)
        assert first.summary.stats["failures_by_reason"] == {"http_503": 2, "http_404": 1}
        image_hits = server.hits["/img/0.jpg"]
        second = download(str(manifest), str(tmp_path / "out"), config, retry_failed=True, progress=False)
        assert server.hits["/img/0.jpg"] == image_hits  # rows that succeeded are not fetched again
        assert server.hits["/404"] == 2  # failed rows are re-attempted (a 404 may have been fixed)
    assert second.summary.stats["failures_by_reason"] == {"http_404": 1}
    assert second.summary.stats["successes"] == 6
    sizes = json.loads((tmp_path / "out" / "sizes.json").read_text())
    # shard 1 (/down/1, /404) had no success at first, so it has no tar of round 0
    assert sizes == {"00000.tar": 4, "00000-retry01.tar": 1, "00001-retry01.tar": 1}
    failures = [json.loads(line) for line in (tmp_path / "out" / "failures.jsonl").read_text().splitlines()]
    assert [f["reason"] for f in failures] == ["http_404"]


def _acquired(manifest, output, *settings: str) -> str:
    """The manifest as `cloob data acquire` writes it: what partitions read."""
    assert main(["data", "acquire", "--source", str(manifest), "--output", str(output),
                 *(flag for setting in settings for flag in ("--set", setting))]) == 0
    return str(output)


def test_a_raw_manifest_is_refused_for_partitions_with_the_acquire_to_run(tmp_path, capsys):
    manifest = write_manifest(tmp_path / "m.csv", [("http://images.example/0.jpg", "a photo")])
    assert main(["data", "download", "--manifest", str(manifest), "--output", str(tmp_path / "out"),
                 "--partition", "3/1000"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "each of the 1000 partitions would read and acquire the whole of it" in line
    assert f"cloob data acquire --source {manifest} --output DIR" in line
    assert not (tmp_path / "out").exists()


def test_partitions_are_disjoint_and_merge_to_the_whole(tmp_path, capsys):
    with ImageServer() as server:
        rows = [(server.url(f"/img/{i}.jpg"), f"photo {i}") for i in range(12)]
        manifest = write_manifest(tmp_path / "m.csv", rows)
        config = load_config(overrides=[*FAST, "preprocess.shard_size=3"])
        whole = download(str(manifest), str(tmp_path / "whole"), config, progress=False)
        acquired = _acquired(manifest, tmp_path / "acquired", "preprocess.shard_size=3")
        for index in range(2):
            download(acquired, str(tmp_path / "parts"), config, partition=Partition(index, 2), progress=False)
    assert not (tmp_path / "parts" / "sizes.json").exists()  # partitions never race on the merged files
    assert main(["data", "merge-stats", "--output", str(tmp_path / "parts")]) == 0
    assert json.loads((tmp_path / "parts" / "sizes.json").read_text()) == whole.summary.sizes
    for name in whole.summary.sizes:
        assert (tmp_path / "parts" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()


def test_private_addresses_are_refused_by_default(tmp_path, capsys):
    with ImageServer() as server:
        manifest = write_manifest(tmp_path / "m.csv", [(server.url("/img/1.jpg"), "on loopback")])
        config = load_config(overrides=[o for o in FAST if "allow_private" not in o])
        result = download(str(manifest), str(tmp_path / "out"), config, progress=False)
        assert server.hits == {}
        assert result.summary.stats["failures_by_reason"] == {"blocked_address": 1}
        # a run in which every URL was refused fails, naming the reason and the flag that allows them
        args = ["data", "download", "--manifest", str(manifest), "--output", str(tmp_path / "cli"), "--no-progress",
                "--image-size", "32"]
        assert main(args) == 2
        captured = capsys.readouterr()
        line = captured.err.strip().splitlines()[-1]
        assert "0 of 1 rows became samples (0%, below validation.min_success_ratio 0.5)" in line
        assert "1 failed as blocked_address" in line and "--allow-private-network" in line
        assert "--retry-failed" in line and "blocked_address" in captured.out  # the summary table too
        # allowed, the retry of the failed rows builds the shard
        assert main([*args, "--allow-private-network", "--retry-failed"]) == 0
        assert "samples written 1 (100.0%)" in capsys.readouterr().out


def test_cli_download_prints_the_summary_table(tmp_path, capsys):
    with ImageServer() as server:
        rows = [(server.url("/img/1.jpg"), "ok"), (server.url("/404"), "gone")]
        manifest = write_manifest(tmp_path / "m.csv", rows, extra=False)
        code = main(["data", "download", "--manifest", str(manifest), "--output", str(tmp_path / "out"),
                     "--allow-private-network", "--image-size", "32", "--processes", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "samples written 1 (50.0%)" in out and "http_404" in out


def test_a_partition_pushes_its_outcome_to_the_pushgateway(tmp_path, pushgateway):
    address, received = pushgateway
    with ImageServer() as server:
        rows = [(server.url("/img/1.jpg"), "ok"), (server.url("/404"), "gone"), (server.url("/html"), "page")]
        manifest = write_manifest(tmp_path / "m.csv", rows, extra=False)
        code = main(["data", "download", "--manifest", str(manifest), "--output", str(tmp_path / "out"),
                     "--allow-private-network", "--image-size", "32", "--processes", "1", "--no-progress",
                     "--set", f"download.pushgateway={address}", "--set", "preprocess.shard_size=2",
                     "--set", "validation.min_success_ratio=0.3", "--partition", "0/1"])
    assert code == 0
    ((path, body),) = received
    # grouped by run (its shards folder) and partition: concurrent downloads into other folders keep their own
    from cloob_core.pushgateway import run_label

    assert path == f"/metrics/job/cloob-download/partition/0-1/run/{run_label(str(tmp_path / 'out'))}"
    for line in ("cloob_download_rows 3.0", "cloob_download_successes 1.0",
                 'cloob_download_failures{reason="http_404"} 1.0',
                 'cloob_download_failures{reason="not_an_image"} 1.0'):
        assert line in body


def test_bad_manifest_gets_a_clear_error(tmp_path, capsys):
    (tmp_path / "m.csv").write_text("link,text\nhttp://example.com/a.jpg,hello\n")
    code = main(["data", "download", "--manifest", str(tmp_path / "m.csv"), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "no column(s) ['url', 'caption']" in err and "'link', 'text'" in err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_resuming_with_other_settings_is_refused_and_loses_nothing(tmp_path, capsys):
    with ImageServer() as server:
        manifest = write_manifest(tmp_path / "m.csv", [(server.url(f"/img/{i}.jpg"), f"p {i}") for i in range(4)])
        args = ["data", "download", "--manifest", str(manifest), "--output", str(tmp_path / "out"),
                "--allow-private-network", "--processes", "1", "--no-progress"]
        assert main([*args, "--image-size", "32"]) == 0
        before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
        capsys.readouterr()
        assert main([*args, "--image-size", "64"]) == 2
        assert "preprocess.image_size: 32 before, 64 now" in capsys.readouterr().err
        write_manifest(manifest, [(server.url(f"/img/{i}.jpg"), f"p {i}") for i in range(5)])
        assert main([*args, "--image-size", "32"]) == 2
        error = capsys.readouterr().err
        assert "manifest: part 0 is 5 rows (sha256 " in error and "now, was 4 rows (sha256 " in error
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


def test_an_unexpected_error_costs_one_row_not_the_shard(tmp_path, monkeypatch):
    import cloob_core.data.download as engine
    import cloob_core.data.worker as worker

    real = worker.process_image

    def exploding(data, config):
        if data == photo_bytes(1):
            raise RuntimeError("codec bug")
        return real(data, config)

    monkeypatch.setattr(worker, "process_image", exploding)
    monkeypatch.setattr(engine, "_CONTEXT", __import__("multiprocessing").get_context("fork"))  # keep the patch
    with ImageServer() as server:
        manifest = write_manifest(tmp_path / "m.csv", [(server.url(f"/img/{i}.jpg"), f"p {i}") for i in range(3)])
        config = load_config(overrides=[*FAST, "download.processes=1"])
        result = download(str(manifest), str(tmp_path / "out"), config, progress=False)
    assert result.summary.stats["successes"] == 2
    assert result.summary.first_failures[0]["reason"] == "processing_error"
    assert "codec bug" in result.summary.first_failures[0]["detail"]


def test_the_gate_stops_an_incomplete_partitioned_download(tmp_path, capsys):
    with ImageServer() as server:
        rows = [(server.url(f"/img/{i}.jpg"), f"photo {i}") for i in range(8)]
        manifest = _acquired(write_manifest(tmp_path / "m.csv", rows), tmp_path / "acquired", "preprocess.shard_size=2")
        config = load_config(overrides=[*FAST, "preprocess.shard_size=2"])
        download(manifest, str(tmp_path / "parts"), config, partition=Partition(0, 2), progress=False)
        assert main(["data", "merge-stats", "--output", str(tmp_path / "parts")]) == 0
        assert "INCOMPLETE: 2 of 4 shards are missing" in capsys.readouterr().out
        assert main(["data", "validate", "--shards", str(tmp_path / "parts")]) == 1
        assert "FAIL shard_totals: expect_column_values_to_be_between [missing_shards]" in capsys.readouterr().out
        download(manifest, str(tmp_path / "parts"), config, partition=Partition(1, 2), progress=False)
        assert main(["data", "merge-stats", "--output", str(tmp_path / "parts")]) == 0
        assert main(["data", "validate", "--shards", str(tmp_path / "parts")]) == 0


def test_a_worker_killed_for_memory_names_the_limit_and_the_setting(tmp_path, monkeypatch):
    """The cgroup's OOM kills rose while the pool ran: the worker was killed for memory, not crashed, and the
    error says which setting gives the download pods more (before: "out of memory? a crashing codec?")."""
    from cloob_core import memory_limit
    from cloob_core.data.download import worker_death

    monkeypatch.setattr(memory_limit, "CGROUP", tmp_path)
    (tmp_path / "memory.max").write_text(str(2 * 2**30))
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    before = memory_limit.oom_kills()
    assert worker_death("00042", before).startswith("a worker process died while building shard 00042")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    text = worker_death("00042", before)
    assert "killed for memory while building shard 00042: the memory limit (2.0 GiB)" in text
    assert "download_memory" in text and "download.processes" in text
    (tmp_path / "memory.events").unlink()  # no cgroup v2 to read: no claim either way
    assert "(out of memory? a crashing codec?)" in worker_death("00042", before)
