"""Kill -9 and SIGTERM in the middle of a download, then re-run: the output must equal an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from image_server import ImageServer
from test_data_download import write_manifest

from cloob_core.config import load_config
from cloob_core.data.download import download

SETTINGS = ["--allow-private-network", "--image-size", "48", "--shard-size", "6", "--processes", "2",
            "--threads", "3", "--connect-timeout", "2", "--read-timeout", "2", "--no-progress"]


def manifest_rows(server: ImageServer) -> list[tuple[str, str]]:
    rows = [(server.url(f"/img/{i}.jpg"), f"photo {i}") for i in range(60)]
    rows[10] = (server.url("/404"), "gone")
    rows[33] = (server.url("/img/2.jpg?again"), "same bytes as row 2, in a later shard")
    rows[47] = (server.url("/img/5.jpg"), "same URL as row 5")
    return rows


def start(manifest: Path, output: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "cloob_core.cli", "data", "download", "--manifest", str(manifest),
               "--output", str(output), *SETTINGS]
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for_shards(output: Path, count: int, process: subprocess.Popen, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while len(list(output.glob("*_stats.json"))) < count:
        assert process.poll() is None, "the download ended before it could be interrupted"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)


def snapshot(output: Path) -> dict[str, bytes]:
    """Every file of the output, byte for byte (records hold no timings: the output is reproducible)."""
    return {path.name: path.read_bytes() for path in sorted(output.iterdir())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of the same manifest (the server is slowed down for the interrupting tests)."""
    tmp = tmp_path_factory.mktemp("reference")
    server = ImageServer(delay=0.15)  # ~1.5 s a run: an interrupt after 2 shards lands mid-run
    with server:
        manifest = write_manifest(tmp / "manifest.csv", manifest_rows(server))
        process = start(manifest, tmp / "out")
        assert process.wait(timeout=120) == 0, process.stderr.read()
        yield server, manifest, snapshot(tmp / "out")


def test_kill_9_then_rerun_equals_uninterrupted_run(reference, tmp_path):
    server, manifest, expected = reference
    output = tmp_path / "out"
    process = start(manifest, output)
    wait_for_shards(output, 3, process)
    os.killpg(process.pid, signal.SIGKILL)  # the whole pod dies: main process and workers
    process.wait(timeout=10)
    done_before = len(list(output.glob("*_stats.json")))
    assert 3 <= done_before < 10
    assert not (output / "sizes.json").exists()
    hits_before = sum(server.hits.values())
    rerun = start(manifest, output)
    assert rerun.wait(timeout=120) == 0, rerun.stderr.read()
    assert f"{done_before} already complete" in rerun.stdout.read()
    assert snapshot(output) == expected  # same shards, keys, bytes, failures and sizes.json
    refetched = sum(server.hits.values()) - hits_before
    assert refetched <= 60 - 6 * done_before + 6  # finished shards were not downloaded again


def test_sigterm_stops_cleanly_and_resumes(reference, tmp_path):
    _, manifest, expected = reference
    output = tmp_path / "out"
    process = start(manifest, output)
    wait_for_shards(output, 2, process)
    process.send_signal(signal.SIGTERM)  # what Kubernetes sends before killing a pod
    assert process.wait(timeout=30) == 130
    assert "re-run the same command to resume" in process.stderr.read()
    assert not list(output.glob(".*")), "staging files left behind"
    config = load_config(overrides=["download.allow_private_network=true", "preprocess.image_size=48",
                                    "preprocess.shard_size=6", "download.processes=2", "download.threads=3",
                                    "download.connect_timeout=2", "download.read_timeout=2"])
    download(str(manifest), str(output), config, progress=False)
    assert snapshot(output) == expected
