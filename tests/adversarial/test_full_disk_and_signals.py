"""A full disk is the user's error in one line, and a stop signal to the whole process group is training's own:
a checkpoint that does not fit keeps the last good one, a download that runs out of space prints its one line and
nothing after it, and SIGTERM to the group stops training at a step with its checkpoint. Disks that fill up for real
are small tmpfs mounts (tests/conftest.py: small_disk)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from hostile import Outcome
from image_server import ImageServer

from cloob_core.training import checkpoint

TRAIN = ["--batch-size", "32", "--workers", "0", "--no-progress", "--no-tensorboard"]


def cloob(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cloob_core.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout)


def only_line(done: subprocess.CompletedProcess | subprocess.Popen, stderr: str | None = None) -> str:
    """The one ``cloob:`` line, the last thing printed (no 'Exception ignored' after it, no traceback)."""
    stderr = done.stderr if stderr is None else stderr
    assert "Exception ignored" not in stderr, stderr
    return Outcome(done.returncode, "", stderr).error_line()


def test_a_checkpoint_that_does_not_fit_is_one_line_and_the_last_good_one_stays(mnist_train_shards, tmp_path,
                                                                                small_disk):
    measured = tmp_path / "measure"
    assert cloob("train", "--shards", mnist_train_shards, "--output", measured, "--steps", "2",
                 "--checkpoint-every", "2", *TRAIN).returncode == 0
    size = (measured / "checkpoints" / "step-00000002.pt").stat().st_size
    output = small_disk(int(1.5 * size) + 64 * 1024)  # room for one checkpoint, not for the next beside it
    done = cloob("train", "--shards", mnist_train_shards, "--output", output, "--steps", "6", "--checkpoint-every",
                 "2", "--keep-checkpoints", "1", *TRAIN)
    assert done.returncode == 2
    line = only_line(done)
    assert line == f"cloob: no space left on device writing {output}/checkpoints/step-00000004.pt", line
    kept = checkpoint.latest(str(output / "checkpoints"))
    assert kept == f"{output}/checkpoints/step-00000002.pt" and checkpoint.load(kept)["step"] == 2
    assert not list(output.rglob("*.tmp")) and not (output / "model").exists()


def test_a_download_that_runs_out_of_space_prints_its_one_line_and_nothing_after(tmp_path, small_disk):
    output = small_disk(96 * 1024)
    with ImageServer() as server:
        urls = [server.url(f"/img/{i}.jpg") for i in range(40)]
        (tmp_path / "m.csv").write_text("url,caption\n" + "".join(f"{u},photo {i}\n" for i, u in enumerate(urls)))
        done = cloob("data", "download", "--manifest", tmp_path / "m.csv", "--output", output, "--no-progress",
                     "--set", "download.allow_private_network=true", "--set", "download.processes=1", "--set",
                     "preprocess.shard_size=4", "--set", "preprocess.image_size=128")
    assert done.returncode == 2
    line = only_line(done)
    assert re.match(rf"cloob: no space left on device writing {re.escape(str(output))}/\S+", line), line
    for stats in output.glob("*_stats.json"):  # what looks complete is complete: each record's tar is whole
        record = json.loads(stats.read_text())
        assert record["tar"] is None or (output / record["tar"]).stat().st_size == record["tar_bytes"]
    assert not list(output.glob(".*.tmp"))


def test_sigterm_to_the_process_group_stops_training_at_a_step_with_its_checkpoint(mnist_train_shards, tmp_path):
    output = tmp_path / "run"
    run = subprocess.Popen([sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(mnist_train_shards),
                            "--output", str(output), "--batch-size", "32", "--workers", "2", "--no-progress",
                            "--no-tensorboard", "--steps", "400", "--checkpoint-every", "1000", "--log-every", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    deadline = time.monotonic() + 300
    for line in run.stderr:  # wait for the event: a few steps logged
        lines.append(line)
        found = re.search(r"step (\d+)/400", line)
        if found and int(found.group(1)) >= 3:
            break
        assert time.monotonic() < deadline, "".join(lines)
    os.killpg(run.pid, signal.SIGTERM)  # as `timeout`, a shell or a container runtime does: the workers too
    stderr = "".join(lines) + run.stderr.read()
    run.wait(timeout=120)
    assert run.returncode == 130, stderr
    line = only_line(run, stderr)
    assert "received SIGTERM at step" in line and "--resume latest" in line and "DataLoader worker" not in stderr
    step = int(line.split("at step ")[1].split(":")[0])
    kept = checkpoint.latest(str(output / "checkpoints"))
    assert kept is not None and checkpoint.load(kept)["step"] == step >= 3
    assert Path(kept).name == checkpoint.checkpoint_name(step)


def test_an_abandoned_shard_stream_is_not_written_again_when_collected():
    """What printed "Exception ignored in _Stream.__del__ … write to closed file" after a download's error line:
    a tar stream whose write failed, collected after its file was closed."""
    import gc

    import pytest

    from cloob_core.data.writer import ShardWriter

    unraisable = []
    previous, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with open("/dev/full", "wb", buffering=0) as stream:  # every write: ENOSPC
            writer = ShardWriter(stream)
            with pytest.raises(OSError, match="No space left"):
                writer.write("000000001", os.urandom(50_000), "a photo", {})
            writer.abandon()
        del writer
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert unraisable == []


def _kill_a_worker(argv: list, after: str | None = None) -> tuple[subprocess.Popen, str]:
    """``cloob ARGV`` with one of its data-loader workers SIGKILLed (as the OOM killer does) once it has some (and,
    with ``after``, once its stderr printed that); its stderr."""
    import psutil

    run = subprocess.Popen([sys.executable, "-m", "cloob_core.cli", *map(str, argv)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    lines = []
    if after is not None:
        for line in run.stderr:
            lines.append(line)
            if after in line:
                break
    deadline = time.monotonic() + 300
    while not (children := psutil.Process(run.pid).children()):
        assert run.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.05)
    children[0].kill()
    stderr = "".join(lines) + run.stderr.read()
    run.wait(timeout=120)
    return run, stderr


def test_a_killed_evaluation_worker_is_one_line_naming_the_setting(tmp_path, untrained_export):
    """It ended in `RuntimeError: DataLoader worker (pid(s) …) exited unexpectedly (an internal error …)`."""
    assert cloob("data", "eval-set", "--source", "mnist", "--output", tmp_path / "mnist",
                 "--shard-size", "100").returncode == 0
    for attempt in range(3):  # kill again where the moment missed: the 1,000 images take a worker a second or two,
        # and on a loaded machine the kill can come after its last batch (the evaluation then ends well), or while
        # a worker starts its queue's feeder thread, whose bootstrap CPython 3.11 then reports as "Exception
        # ignored ... KeyError" (its threading module's race, not ours)
        run, stderr = _kill_a_worker(["eval", "zeroshot", "--model", untrained_export, "--data", tmp_path / "mnist",
                                      "--output", tmp_path / f"out{attempt}", "--no-cache", "--no-progress",
                                      "--workers", "2", "--batch-size", "4"])
        if run.returncode != 0 and "QueueFeederThread" not in stderr:
            break
    assert run.returncode == 2, stderr
    line = only_line(run, stderr)
    assert "a data-loader worker was killed, most likely by the kernel's OOM killer for memory" in line, line
    assert "lower --workers (here 2) or --batch-size (here 4)" in line, line


def test_a_killed_training_worker_is_one_line_naming_the_setting_and_the_checkpoint(mnist_train_shards, tmp_path):
    run, stderr = _kill_a_worker(["train", "--shards", mnist_train_shards, "--output", tmp_path / "run", "--steps",
                                  "400", "--batch-size", "32", "--workers", "2", "--no-progress", "--no-tensorboard",
                                  "--checkpoint-every", "2", "--log-every", "1"], after="step 3/400")
    assert run.returncode == 2, stderr
    line = only_line(run, stderr)
    assert "a data-loader worker was killed, most likely by the kernel's OOM killer for memory" in line, line
    assert "lower train.workers (--workers; here 2) or train.batch_size; --resume latest continues from " in line
    assert checkpoint.latest(str(tmp_path / "run" / "checkpoints")) in line
