"""A writer that lost its lease cannot write: writer A is paused (SIGSTOP, as a frozen node or a long pause would)
past its lease's time to live at one of its publishing moments; writer B takes the lease over and finishes; then A
resumes. A publishes nothing more and fails in one line; the output is B's. Locally the lease is a ``flock``,
which a paused holder keeps: B is refused and A finishes. And what makes a lease stale is judged right: the same
host name is not the same machine, a lease with a time to live that is not a number never lives forever, and a
store without a Date header is watched, not judged by this machine's clock."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from killing import paused, resume, run

from cloob_core import lease, scratch, storage
from cloob_core.data.run_manifest import RunManifest

TTL = "2"
SHORT_LEASE = {"CLOOB_TEST_LEASE_TTL_S": TTL}


def _source(folder: Path, parts: int, rows: int, tag: str) -> Path:
    folder.mkdir(parents=True)
    for part in range(parts):
        lines = ["url,caption"] + [f"http://example.com/{tag}/{part}/{i}.jpg,{tag} {part} {i}" for i in range(rows)]
        (folder / f"part-{part}.csv").write_text("\n".join(lines) + "\n")
    return folder


# where A stops: before its first part is published, before the URL duplicates, right before its index (after
# the lease was checked: the index's own conditional write fences it)
PAUSES = ["check_held||1", "upload_file|_url_duplicates|1", "write_if_unchanged|_manifest.json|1"]


@pytest.mark.parametrize("pause", PAUSES)
def test_a_paused_writer_on_s3_publishes_nothing_after_its_lease_was_taken(tmp_path, s3_bucket, fault_proxy, pause):
    fault_proxy.add("latency", method=None, times=None, seconds=0.01)  # a store some way off, for every request
    fault_proxy.add("slowdown", method="PUT", key="/out/part-", times=1)  # and one that pushes back once
    out = f"s3://{s3_bucket}/out"
    big, small = _source(tmp_path / "big", 3, 200, "a"), _source(tmp_path / "small", 1, 27, "b")
    writer_a = paused(["data", "acquire", "--source", big, "--output", out], tmp_path / "a", pause, SHORT_LEASE)
    time.sleep(float(TTL) + 1.5)  # A's lease lapses: its renewals are paused with it
    b = run(["data", "acquire", "--source", small, "--output", out], tmp_path / "b", env=SHORT_LEASE)
    assert b.code == 0, b.err
    assert "taking over the lease" in b.err
    published = {name: size for name, size, _ in storage.tree_entries(out)}
    a = resume(writer_a)
    line = a.error_line()
    assert a.code == 2 and ("lost" in line or "replaced by another run" in line), a.err
    assert {name: size for name, size, _ in storage.tree_entries(out)} == published  # A wrote nothing more
    assert len(RunManifest.open(out)) == 27  # B's rows


def test_a_paused_writer_on_s3_leaves_a_merge_of_another_run_alone(tmp_path, s3_bucket, fault_proxy,
                                                                    mnist_train_shards):
    fault_proxy.add("reset-after", method="PUT", key=".cloob-unit", times=1)  # a lost reply on B's switch
    out = f"s3://{s3_bucket}/shards"
    storage.upload_tree(mnist_train_shards, out)
    writer_a = paused(["data", "merge-stats", "--output", out], tmp_path / "a", "check_held||1", SHORT_LEASE)
    time.sleep(float(TTL) + 1.5)
    storage.delete(storage.join(out, "00015_stats.json"))  # a shard's record goes: B's summary differs from A's
    b = run(["data", "merge-stats", "--output", out], tmp_path / "b", env=SHORT_LEASE)
    assert b.code == 0 and "INCOMPLETE: 1 of 16" in b.out, b.err
    published = {name: etag for name, _, etag in storage.tree_entries(out)}
    a = resume(writer_a)
    assert a.code == 2 and "lost" in a.error_line(), a.err
    assert {name: etag for name, _, etag in storage.tree_entries(out)} == published


def test_a_paused_local_writer_keeps_its_lease_and_finishes(tmp_path):
    out = tmp_path / "out"
    big, small = _source(tmp_path / "big", 2, 50, "a"), _source(tmp_path / "small", 1, 27, "b")
    writer_a = paused(["data", "acquire", "--source", big, "--output", out], tmp_path / "a", "upload_file||1")
    time.sleep(1)
    b = run(["data", "acquire", "--source", small, "--output", out], tmp_path / "b")
    line = b.error_line()
    assert b.code == 2 and "is being written by another run" in line and f"pid {writer_a.pid}" in line
    a = resume(writer_a)
    assert a.code == 0, a.err
    assert len(RunManifest.open(str(out))) == 100


def _lease_object(s3_bucket: str, holder: dict) -> str:
    out = f"s3://{s3_bucket}/out"
    storage.write_bytes(storage.join(out, lease.lease_name()), json.dumps(holder).encode())
    return out


def _dead_pid() -> int:
    pid = 4_000_000
    while scratch.alive(pid):
        pid -= 1
    return pid


def _holder(**fields) -> dict:
    return {"host": socket.gethostname(), "pid": _dead_pid(), "started": "2026-11-26T00:00:00+00:00",
            "token": "theirs", "ttl_s": 60.0, "machine": scratch.machine_id(), **fields}


def test_a_fresh_lease_of_another_machine_with_the_same_host_name_is_not_taken(s3_bucket, fault_proxy):
    # pods and containers reuse host names: its pid says nothing here, so a fresh lease is busy
    out = _lease_object(s3_bucket, _holder(machine="another-boot/pid:[4026531836]"))
    with pytest.raises(lease.OutputBusy, match="being written by another run"), lease.writing(out):
        pass
    # on this machine and pid namespace, a holder whose process is gone is taken over at once
    out = _lease_object(s3_bucket, _holder())
    with lease.writing(out):
        assert json.loads(storage.read_bytes(storage.join(out, lease.lease_name())))["pid"] == os.getpid()


@pytest.mark.parametrize("ttl", ["NaN", "Infinity", -1, 0, 1e12, "soon"])
def test_a_lease_whose_time_to_live_is_not_a_number_does_not_live_forever(s3_bucket, fault_proxy, ttl, caplog):
    out = _lease_object(s3_bucket, _holder(ttl_s=ttl, machine="elsewhere"))
    with lease.writing(out):
        pass
    assert "unreadable" in caplog.text


def test_without_the_servers_date_a_lease_is_watched_not_judged_by_our_clock(s3_bucket, monkeypatch, caplog):
    monkeypatch.setattr(lease, "_server_time", lambda reply: None)
    # an abandoned lease of another machine: unchanged while watched for its time to live, then taken over
    out = _lease_object(s3_bucket, _holder(ttl_s=1.0, machine="elsewhere"))
    started = time.monotonic()
    with lease.writing(out):
        pass
    assert time.monotonic() - started >= 1.0 and "no Date header" in caplog.text
    # a live holder renews within its time to live: busy
    out = _lease_object(s3_bucket, _holder(ttl_s=1.0, machine="elsewhere"))
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(0.3):
            storage.write_bytes(storage.join(out, lease.lease_name()),
                                json.dumps(_holder(ttl_s=1.0, machine="elsewhere", started=str(time.time()))).encode())

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(lease.OutputBusy), lease.writing(out):
            pass
    finally:
        stop.set()
        renewer.join()
