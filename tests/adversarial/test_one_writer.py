"""One writer per output: a second run into an output another run is writing is refused at once, naming the holder,
and touches nothing; a dead holder's lease is taken over (and that is logged); on S3 the lease is renewed while its
holder lives, taken over when it lapses, and a holder that lost it does not report success."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hostile import Outcome, cli, poised, snapshot, wait_for

from cloob_core import lease, storage

# A process that holds the lease on argv[1] (name argv[2]) until it is killed; it says so by creating argv[3].
HOLDER = textwrap.dedent("""
    import pathlib, sys, time
    from cloob_core import lease
    with lease.writing(sys.argv[1], sys.argv[2]):
        pathlib.Path(sys.argv[3]).touch()
        while True:
            time.sleep(1)
""")


def start_holder(tmp_path: Path, location: str, name: str = "") -> subprocess.Popen:
    ready = tmp_path / f"holding-{time.monotonic_ns()}"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, location, name, str(ready)])
    wait_for(ready.exists, "lease held", processes=(holder,))
    return holder


def test_a_second_training_into_the_same_output_is_refused_naming_the_first(mnist_train_shards, tmp_path):
    output = tmp_path / "run"
    command = [sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(mnist_train_shards), "--output",
               str(output), "--batch-size", "32", "--workers", "0", "--no-progress", "--no-tensorboard",
               "--checkpoint-every", "2", "--keep-checkpoints", "1"]
    first = subprocess.Popen([*command, "--steps", "16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any(output.glob("checkpoints/step-*.pt")), "first checkpoint", processes=(first,))
    os.kill(first.pid, signal.SIGSTOP)  # still holding its lease, however fast it would have finished
    try:
        second = subprocess.run([*command, "--steps", "4"], capture_output=True, text=True, timeout=300)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 2
    line = Outcome(second.returncode, second.stdout, second.stderr).error_line()
    assert f"{output} is being written by another run (host " in line and f"pid {first.pid}, started " in line
    _, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr
    assert (output / "model").is_dir() and not list(output.glob(".cloob-lease*"))
    from cloob_core.training import checkpoint

    assert checkpoint.load(checkpoint.latest(str(output / "checkpoints")))["step"] == 16  # the first run's end


def test_a_second_evaluation_into_the_same_output_is_refused_and_the_first_results_stand(tmp_path, weights):
    import torch

    from cloob_core.config import ModelConfig
    from cloob_core.model.dual_encoder import build_model

    other = tmp_path / "other.pt"
    torch.manual_seed(1)
    torch.save(build_model(ModelConfig()).encoder.state_dict(), other)
    output = tmp_path / "eval"
    suite = ["eval", "suite", "--dataset", "mnist", "--task", "zeroshot", "--task", "linear-probe",
             "--architecture", "cloob-tiny", "--output", str(output), "--no-progress"]
    ready, go = tmp_path / "ready", tmp_path / "go"
    second = poised(ready, go, [*suite, "--weights", other], preload=("cloob_core.evaluation.suite",))
    wait_for(ready.exists, "the second evaluation ready", processes=(second,))
    first = subprocess.Popen([sys.executable, "-m", "cloob_core.cli", *suite, "--weights", str(weights)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: any(output.glob(".cloob-lease*")), "the first evaluation's lease", processes=(first,))
    go.touch()  # the first is loading its model and encoding 5,000 images: tens of seconds
    _, second_err = second.communicate(timeout=300)
    assert second.returncode == 2 and f"pid {first.pid}" in Outcome(2, "", second_err).error_line()
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    results = (output / "mnist" / "mnist_zeroshot_classification.json").read_text()
    assert str(weights) in results and str(other) not in results


def test_a_dead_holders_lease_is_taken_over_and_that_is_logged(capsys, caplog, tmp_path):
    output = tmp_path / "manifest"
    holder = start_holder(tmp_path, str(output))
    before = snapshot(output)
    refused = cli(capsys, "data", "acquire", "--output", output)
    assert refused.code == 2 and f"pid {holder.pid}" in refused.error_line()
    assert snapshot(output) == before
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    with caplog.at_level(logging.WARNING, logger="cloob_core.lease"):
        done = cli(capsys, "data", "acquire", "--output", output)
    assert done.code == 0, done.err
    assert f"pid {holder.pid}" in caplog.text and "ended without releasing it" in caplog.text
    assert (output / "_manifest.json").is_file() and not list(output.glob(".cloob-lease*"))


def test_an_s3_download_partition_is_leased_and_a_dead_holder_is_taken_over(capsys, caplog, tmp_path, s3_bucket):
    output = f"s3://{s3_bucket}/shards"
    holder = start_holder(tmp_path, output, "p0of1")
    manifest = tmp_path / "m.csv"
    manifest.write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a cat\n")
    refused = cli(capsys, "data", "download", "--manifest", manifest, "--output", output, "--no-progress",
                  "--retries", "0")
    line = refused.error_line()
    assert refused.code == 2 and f"partition 0/1 of {output} is being written by another run" in line
    assert f"pid {holder.pid}" in line and storage.list_names(output) == []
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    with caplog.at_level(logging.WARNING, logger="cloob_core.lease"):
        done = cli(capsys, "data", "download", "--manifest", manifest, "--output", output, "--no-progress",
                   "--retries", "0", "--allow-private-network", "--set", "validation.min_success_ratio=0")
    assert done.code == 0, done.err  # (its one URL goes nowhere: what is tested is the lease)
    assert "its process is no longer running" in caplog.text
    assert not [key for key in storage.tree_entries(output) if ".cloob-lease" in key[0]]
    bucket, prefix = storage.split_s3(output)
    listed = storage.s3_client().list_objects_v2(Bucket=bucket, Prefix=prefix + "/.cloob-lease")
    assert not listed.get("KeyCount")  # released


def _foreign_lease(location: str) -> None:
    storage.write_bytes(location, lease.Holder("node-elsewhere", 1, "2026-11-24T00:00:00+00:00", "theirs",
                                               lease.TTL_S).encode())


def test_an_s3_lease_that_is_not_renewed_lapses_and_is_taken_over(tmp_path, s3_bucket, monkeypatch, caplog):
    monkeypatch.setattr(lease, "TTL_S", 1.0)
    output = f"s3://{s3_bucket}/eval"
    _foreign_lease(storage.join(output, lease.lease_name()))
    with pytest.raises(lease.OutputBusy, match="host node-elsewhere, pid 1"), lease.writing(output):
        pass

    def taken() -> bool:
        try:
            with lease.writing(output):
                return True
        except lease.OutputBusy:
            return False

    with caplog.at_level(logging.WARNING, logger="cloob_core.lease"):
        wait_for(taken, "takeover of the lapsed lease", timeout=30)
    assert "from host node-elsewhere, pid 1" in caplog.text and "not renewed for" in caplog.text


def test_an_s3_lease_is_renewed_while_held_and_a_holder_that_lost_it_fails(tmp_path, s3_bucket, monkeypatch):
    monkeypatch.setattr(lease, "TTL_S", 4.0)  # well above the 1 s resolution of HTTP dates and a loaded scheduler
    output = f"s3://{s3_bucket}/renewed"
    location = storage.join(output, lease.lease_name())
    held, release = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def hold() -> None:
        try:
            with lease.writing(output):
                held.set()
                release.wait(30)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    start = time.monotonic()
    while time.monotonic() - start < 2.5 * lease.TTL_S:  # several lifetimes: the renewals keep it
        with pytest.raises(lease.OutputBusy, match=f"pid {os.getpid()}"), lease.writing(output):
            pass  # this thread is another writer
        time.sleep(0.1)
    release.set()
    holder.join(30)
    assert outcome == [None] and not storage.exists(location)

    # a holder that stalls (its renewals stop) past the time to live loses the lease and fails at the end
    monkeypatch.setattr(lease._Renewal, "run", lambda self: None)
    held.clear()
    release.clear()
    outcome.clear()
    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    _foreign_lease(location)  # a contender took the lapsed lease
    release.set()
    holder.join(30)
    assert isinstance(outcome[0], lease.LeaseLost) and "was lost while this run wrote it" in str(outcome[0])


@pytest.mark.parametrize("fault", ["error-after", "reset-after"])
def test_an_s3_lease_whose_create_reply_is_lost_is_still_its_holders(s3_bucket, fault_proxy, fault):
    output = f"s3://{s3_bucket}/flaky-{fault}"
    location = storage.join(output, lease.lease_name())
    injected = fault_proxy.add(fault, key=f"/flaky-{fault}/.cloob-lease.json")  # the create applied, its reply lost
    fault_proxy.add("slowdown", method=None, key=f"/flaky-{fault}/", times=2)
    with lease.writing(output):
        holder = lease.Holder.parse(storage.read_bytes(location))
        assert injected.hits == 1 and holder.pid == os.getpid()
        with pytest.raises(lease.OutputBusy, match=f"pid {os.getpid()}"):  # and it excludes others
            threading_writer(output)
    assert not storage.exists(location)


def threading_writer(output: str) -> None:
    """Take the lease on ``output`` from another thread (another writer in this process); its error re-raised."""
    errors: list[BaseException] = []

    def take() -> None:
        try:
            with lease.writing(output):
                pass
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(60)
    if errors:
        raise errors[0]
