"""The data stages under hostile input: a server that drips its headers, metadata addresses in IPv6 disguise,
other people's files in the output folder, two downloads at once, shards whose bytes are garbage under the right
names, a caption of megabytes and files that are not what their names say."""

from __future__ import annotations

import fcntl
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from hostile import cli, snapshot
from image_server import ImageServer

GUARDED = ["--set", "download.connect_timeout=1", "--set", "download.read_timeout=1", "--set",
           "download.url_deadline=2", "--set", "download.retries=0", "--set", "download.processes=1", "--set",
           "download.threads=4", "--set", "preprocess.image_size=32", "--set", "preprocess.shard_size=4",
           "--no-progress"]
FAST = ["--set", "download.allow_private_network=true", *GUARDED]  # the test server is on loopback


def manifest(path: Path, urls: list[str]) -> Path:
    path.write_text("url,caption\n" + "".join(f"{url},photo {i}\n" for i, url in enumerate(urls)))
    return path


def failures(out: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    return {row["url"]: row["reason"] for row in rows}


def test_a_server_dripping_its_headers_is_cut_at_the_url_deadline(capsys, tmp_path):
    with ImageServer() as server:
        urls = [server.url("/drip-headers"), server.url("/img/1.jpg")]
        started = time.monotonic()
        done = cli(capsys, "data", "download", "--manifest", manifest(tmp_path / "m.csv", urls), "--output",
                   tmp_path / "out", *FAST)
        elapsed = time.monotonic() - started
    assert done.code == 0, done.err
    assert failures(tmp_path / "out") == {urls[0]: "deadline_exceeded"}
    assert elapsed < 20  # the drip lasts a minute; the deadline is 2 s (+1 s grace)


@pytest.mark.parametrize("host", ["[64:ff9b::a9fe:a9fe]", "[2002:a9fe:a9fe::1]", "[::a9fe:a9fe]",
                                  "[64:ff9b::7f00:1]"])
def test_metadata_and_loopback_addresses_inside_ipv6_are_refused_before_connecting(capsys, tmp_path, host):
    url = f"http://{host}/latest/meta-data/"
    done = cli(capsys, "data", "download", "--manifest", manifest(tmp_path / "m.csv", [url]), "--output",
               tmp_path / "out", *GUARDED)
    assert done.code == 2 and "1 failed as blocked_address" in done.error_line()  # nothing fetched: a failure
    assert failures(tmp_path / "out") == {url: "blocked_address"}


def test_a_download_deletes_neither_a_users_files_nor_another_partitions_staging(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    mine = out / ".notes.tmp"
    mine.write_text("the user's own notes")
    theirs = out / ".00002.tar.p1of2.4242.tmp"  # partition 1/2 (shards 2 and 3), still writing
    theirs.write_bytes(b"half a tar")
    left_by_a_killed_run = out / ".00000.tar.p0of2.77.tmp"
    left_by_a_killed_run.write_bytes(b"stale")
    half_written_record = out / ".00001_stats.json.k1ll3d.tmp"  # killed mid-way through its atomic write
    half_written_record.write_bytes(b'{"name": "00002", "sha')
    their_record = out / ".00003_failures.jsonl.wr1t1ng.tmp"  # partition 1/2's, being written
    their_record.write_bytes(b"{}")
    with ImageServer() as server:
        urls = [server.url(f"/img/{i}.jpg") for i in range(8)]
        acquired = tmp_path / "acquired"  # what partitions read
        assert cli(capsys, "data", "acquire", "--source", manifest(tmp_path / "m.csv", urls), "--output", acquired,
                   "--set", "preprocess.shard_size=2").code == 0
        done = cli(capsys, "data", "download", "--manifest", acquired, "--output", out,
                   "--partition", "0/2", "--shard-size", "2", *FAST)  # shards 0 and 1 of 4
    assert done.code == 0, done.err
    assert mine.read_text() == "the user's own notes" and theirs.read_bytes() == b"half a tar"
    assert not left_by_a_killed_run.exists() and not half_written_record.exists()  # its partition's leftovers go
    assert their_record.exists()
    assert (out / "00000.tar").exists() and (out / "00001.tar").exists() and not (out / "00002.tar").exists()


def test_a_second_run_of_the_same_partition_is_refused_and_touches_nothing(capsys, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    staging = out / ".00000.tar.p0of1.4242.tmp"
    staging.write_bytes(b"being written by the running download")
    with open(out / ".cloob-lease.p0of1.json", "a") as running:  # a live run holds its partition's lease
        fcntl.flock(running, fcntl.LOCK_EX)
        running.write('{"host": "node-7", "pid": 4242, "started": "2026-11-24T01:02:03+00:00", "token": "t"}')
        running.flush()
        before = snapshot(out)
        done = cli(capsys, "data", "download", "--manifest", manifest(tmp_path / "m.csv", ["http://127.0.0.1:9/x.jpg"]),
                   "--output", out, *FAST)
        assert snapshot(out) == before
    assert done.code == 2
    assert (f"partition 0/1 of {out} is being written by another run (host node-7, pid 4242, started "
            "2026-11-24T01:02:03+00:00)") in done.error_line()


def test_two_partitions_write_into_one_folder_at_the_same_time(tmp_path):
    out = tmp_path / "out"
    with ImageServer(delay=0.05) as server:
        path = tmp_path / "acquired"
        raw = manifest(tmp_path / "m.csv", [server.url(f"/img/{i}.jpg") for i in range(24)])
        assert subprocess.run([sys.executable, "-m", "cloob_core.cli", "data", "acquire", "--source", str(raw),
                               "--output", str(path)]).returncode == 0  # what partitions read
        runs = [subprocess.Popen([sys.executable, "-m", "cloob_core.cli", "data", "download", "--manifest",
                                  str(path), "--output", str(out), "--partition", f"{i}/2", *FAST],
                                 stderr=subprocess.PIPE, text=True)
                for i in range(2)]
        errors = [run.communicate(timeout=300)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], errors
    assert sorted(p.name for p in out.glob("*.tar")) == [f"{i:05d}.tar" for i in range(6)]
    assert not list(out.glob(".*"))  # no staging and no lock left behind


def _rewrite_tar(path: Path, change) -> None:
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for index, (member, data) in enumerate(members):
            data = change(index, member.name, data)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    path.write_bytes(buffer.getvalue())


@pytest.fixture
def shards(mnist_train_shards, tmp_path) -> Path:
    copy = tmp_path / "shards"
    shutil.copytree(mnist_train_shards, copy)
    return copy


def test_the_gate_decodes_a_sample_and_names_shards_of_random_bytes(capsys, shards):
    noise = random.Random(0)
    _rewrite_tar(shards / "00003.tar", lambda i, name, data: noise.randbytes(len(data))
                 if name.endswith(".jpg") and i % 2 else data)
    done = cli(capsys, "data", "validate", "--shards", shards)
    assert done.code == 1 and "data gate FAILED: 1 of" in done.error_line()
    failed = [line for line in done.out.splitlines() if line.startswith("  FAIL")]
    assert len(failed) == 1 and "[undecodable]" in failed[0] and "00003.tar" in failed[0], done.out


def test_the_gate_fails_shards_whose_json_is_garbage(capsys, shards):
    _rewrite_tar(shards / "00007.tar", lambda i, name, data: b"\x00garbage{" if name.endswith(".json") else data)
    done = cli(capsys, "data", "validate", "--shards", shards)
    assert done.code == 1
    failed = [line for line in done.out.splitlines() if line.startswith("  FAIL")]
    assert len(failed) == 1 and "00007.tar" in failed[0] and "json (" in failed[0], done.out


def test_a_tolerance_lets_a_few_bad_samples_through(capsys, shards):
    _rewrite_tar(shards / "00003.tar", lambda i, name, data: b"junk" if name == "000000750.jpg" else data)
    assert cli(capsys, "data", "validate", "--shards", shards).code == 1
    assert cli(capsys, "data", "validate", "--shards", shards, "--set",
               "validation.max_undecodable_fraction=0.1").code == 0


def test_the_gate_prints_a_huge_caption_cut_short(capsys, tmp_path):
    huge = "a" * 8_000_000
    path = tmp_path / "m.csv"
    path.write_text(f"url,caption\nhttp://example.com/1.jpg,{huge}\nhttp://example.com/2.jpg,a dog\n")
    done = cli(capsys, "data", "validate", "--manifest", path)
    assert done.code == 1 and "data gate FAILED" in done.error_line()
    assert max(len(line) for line in done.out.splitlines()) < 1000
    assert "(8000002 chars)" in done.out  # the value's length is still reported


def test_a_broken_sizes_json_is_named(capsys, shards, tmp_path):
    (shards / "sizes.json").write_text("{truncated")
    done = cli(capsys, "train", "--shards", shards, "--output", tmp_path / "run", "--steps", "1")
    # published by merge-stats with the other summary files: the damage is named as such
    assert done.code == 2 and "sizes.json does not match the output published" in done.error_line()
    (shards / ".cloob-unit.json").unlink()  # a sizes.json of another tool: named as not JSON
    done = cli(capsys, "train", "--shards", shards, "--output", tmp_path / "run", "--steps", "1")
    assert done.code == 2 and "sizes.json is not valid JSON" in done.error_line()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_training_on_shards_where_nothing_decodes_stops_instead_of_spinning(shards, tmp_path):
    for tar in shards.glob("*.tar"):
        _rewrite_tar(tar, lambda i, name, data: b"not an image" if name.endswith(".jpg") else data)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(shards), "--output",
                           str(tmp_path / "run"), "--steps", "5", "--batch-size", "32", "--workers", "1",
                           "--no-progress", "--no-tensorboard"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert time.monotonic() - started < 240
    from hostile import Outcome

    line = Outcome(done.returncode, done.stdout, done.stderr).error_line()
    assert done.returncode == 2 and "without one decodable sample" in line, done.stderr
    assert not (tmp_path / "run" / "model").exists()


def test_an_output_that_is_a_file_is_refused_before_any_work(capsys, tmp_path, mnist_train_shards):
    taken = tmp_path / "run"
    taken.write_text("a file the user keeps here")
    started = time.monotonic()
    done = cli(capsys, "train", "--shards", mnist_train_shards, "--output", taken, "--steps", "1")
    assert done.code == 2 and "is a file, not a folder" in done.error_line()
    assert time.monotonic() - started < 10 and taken.read_text() == "a file the user keeps here"
    done = cli(capsys, "data", "shards", "--source", "mnist", "--output", taken, "--no-progress")
    assert done.code == 2 and "is a file, not a folder" in done.error_line()
