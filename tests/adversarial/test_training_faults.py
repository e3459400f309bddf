"""Training under faults a scheduled run meets with nobody watching: a divergent learning rate, a checkpoint
damaged on disk, and Kubernetes stopping the pod. Each ends with a non-zero exit status and one line naming the
problem, never a traceback, and never a broken model presented as a result."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BASE = ["--batch-size", "32", "--workers", "0", "--no-progress", "--no-tensorboard"]


def train(shards: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(shards), "--output",
                           str(output), *BASE, *extra], capture_output=True, text=True, timeout=600)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("cloob: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_diverging_run_fails_naming_the_step_and_keeps_the_last_good_checkpoint(mnist_train_shards, tmp_path):
    output = tmp_path / "run"
    done = train(mnist_train_shards, output, "--steps", "12", "--checkpoint-every", "2", "--log-every", "1",
                 "--set", "optim.lr=1e8", "--set", "optim.warmup_steps=0")
    assert done.returncode == 2
    line = one_error_line(done)
    assert "training diverged by step" in line and "optim.lr" in line
    assert not (output / "model").exists()  # no export of a broken model
    import torch

    from cloob_core.training import checkpoint

    kept = checkpoint.latest(str(output / "checkpoints"))
    if kept is not None:  # whatever was saved is finite
        state = checkpoint.load(kept)["model"]
        assert all(torch.isfinite(value).all() for value in state.values() if value.is_floating_point())


def test_a_damaged_or_incomplete_checkpoint_is_refused_by_name(mnist_train_shards, tmp_path):
    output = tmp_path / "run"
    assert train(mnist_train_shards, output, "--steps", "2", "--checkpoint-every", "2").returncode == 0
    saved = output / "checkpoints" / "step-00000002.pt"
    data = bytearray(saved.read_bytes())
    for offset in range(len(data) // 2, len(data) // 2 + 64):  # 64 flipped bytes inside the archive
        data[offset] ^= 0xFF
    saved.write_bytes(bytes(data))
    done = train(mnist_train_shards, output, "--steps", "4", "--resume", "latest")
    assert done.returncode == 2 and "is corrupt" in one_error_line(done)
    (output / "checkpoints" / "step-00000002.pt.sha256").unlink()
    done = train(mnist_train_shards, output, "--steps", "4", "--resume", str(saved))
    assert done.returncode == 2 and "not written completely" in one_error_line(done)


def test_sigterm_stops_at_a_step_and_saves_where_it_stood(mnist_train_shards, tmp_path):
    output = tmp_path / "run"
    command = [sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(mnist_train_shards), "--output",
               str(output), "--batch-size", "32", "--workers", "0", "--no-progress", "--steps", "400",
               "--checkpoint-every", "1000"]
    run = subprocess.Popen([*command, "--log-every", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    lines, deadline = [], time.monotonic() + 300
    for line in run.stderr:  # wait for the event, a few steps logged, not for a time
        lines.append(line)
        if (found := re.search(r"step (\d+)/400", line)) and int(found.group(1)) >= 3:
            break
        assert time.monotonic() < deadline, "".join(lines)
    run.send_signal(signal.SIGTERM)
    stderr = "".join(lines) + run.stderr.read()
    run.wait(timeout=120)
    assert run.returncode == 130, stderr
    line = one_error_line(subprocess.CompletedProcess(command, run.returncode, "", stderr))
    assert "received SIGTERM at step" in line and "--resume latest" in line
    step = int(line.split("at step ")[1].split(":")[0])
    from cloob_core.training import checkpoint

    kept = checkpoint.latest(str(output / "checkpoints"))
    assert kept is not None and checkpoint.load(kept)["step"] == step > 0  # saved where it stood
    assert not (output / "model").exists()


def test_a_stuck_data_loader_is_a_clear_error_not_a_hang(mnist_train_shards, tmp_path):
    done = subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--shards", str(mnist_train_shards),
                           "--output", str(tmp_path / "run"), "--batch-size", "32", "--workers", "1", "--steps", "3",
                           "--no-progress", "--no-tensorboard", "--set", "train.data_timeout_s=0.01"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "no data from the data-loader workers within 0.01 s" in one_error_line(done)
    assert not (tmp_path / "run" / "model").exists()


@pytest.mark.slow  # ~40 s, in the slow phase for the default one's budget (docs/development.md)
def test_starting_weights_read_from_s3_through_a_flaky_network(mnist_train_shards, tmp_path, s3_bucket, fault_proxy,
                                                             monkeypatch):
    """train.init_from on S3 whose body is cut mid-read (the headers promise the object, half of it comes, the
    connection drops): a cut once is read again and the run trains; a cut on every try is one line naming the
    object, exit 2, not "an internal error". For a model folder and for a weights file alike."""
    from cloob_core import storage

    source = tmp_path / "source"
    assert train(mnist_train_shards, source, "--steps", "1").returncode == 0
    folder, weights = f"s3://{s3_bucket}/weights", f"s3://{s3_bucket}/file/open_clip_model.safetensors"
    storage.upload_tree(str(source / "model"), folder)
    storage.copy_file(source / "model" / "open_clip_model.safetensors", weights)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    for number, init_from in enumerate((folder, weights)):
        fault_proxy.clear()
        fault_proxy.add("cut-body", method="GET", key="open_clip_model.safetensors", times=1)
        done = train(mnist_train_shards, tmp_path / f"once-{number}", "--steps", "1", "--set",
                     f"train.init_from={init_from}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert "while reading (try 1 of 3)" in done.stderr, done.stderr[-4000:]
        assert any("body cut at half" in what for _, _, what in fault_proxy.log)
        fault_proxy.clear()
        fault_proxy.add("cut-body", method="GET", key="open_clip_model.safetensors", times=None)
        done = train(mnist_train_shards, tmp_path / f"always-{number}", "--steps", "1", "--set",
                     f"train.init_from={init_from}")
        assert done.returncode == 2, done.stderr[-3000:]
        line = one_error_line(done)
        assert "open_clip_model.safetensors: reading it failed 3 times" in line and "internal error" not in line


@pytest.mark.slow  # ~35 s, in the slow phase for the default one's budget (docs/development.md)
def test_a_corrupt_newest_checkpoint_is_passed_over_for_the_one_before_it(mnist_train_shards, tmp_path):
    """What an unattended resume (DVC's --resume auto, a restarted pod's latest) does with a newest checkpoint
    whose bytes no longer match their checksum: a warning naming it, the run continued from the checkpoint before,
    and the same weights as a run never damaged. A checkpoint named by its path is still refused."""
    import torch
    from safetensors.torch import load_file

    whole = tmp_path / "whole"
    assert train(mnist_train_shards, whole, "--steps", "6", "--checkpoint-every", "2").returncode == 0
    for resume in ("auto", "latest"):
        output = tmp_path / resume
        shutil.copytree(whole, output)  # a run whose newest checkpoint, its last, is then damaged
        newest = output / "checkpoints" / "step-00000006.pt"
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
        shutil.rmtree(output / "model")
        done = train(mnist_train_shards, output, "--steps", "6", "--checkpoint-every", "2", "--resume", resume)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "step-00000006.pt is corrupt" in done.stderr and "passing it over" in done.stderr
        assert json.loads((output / "metrics.json").read_text())["resumed_from_step"] == 4
        ours, reference = (load_file(folder / "model" / "open_clip_model.safetensors") for folder in (output, whole))
        assert all(torch.equal(ours[key], reference[key]) for key in reference)
    assert newest.read_bytes() != bytes(data)  # trained again from step 4: a whole checkpoint in its place
    newest.write_bytes(bytes(data))
    done = train(mnist_train_shards, tmp_path / "named", "--steps", "6", "--resume", str(newest))
    assert done.returncode == 2 and "is corrupt" in one_error_line(done)
