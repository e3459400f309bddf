"""The checkpoint mirror uploads in the background: saving returns at once however slow the store (no other rank
waits for it in a collective), the newest waiting checkpoint replaces an older one, retention holds there too,
and a failed upload stops the run at the next checkpoint or at the end, naming the object."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cloob_core import storage
from cloob_core.training import checkpoint


def saved(folder: Path, step: int, keep: int = 3) -> Path:
    return checkpoint.save({"step": step}, folder, step, keep)


def test_uploads_run_beside_the_loop_and_keep_the_newest(tmp_path, monkeypatch):
    mirror_folder = tmp_path / "mirror"
    mirror_folder.mkdir()
    release, uploading = threading.Event(), threading.Event()
    real_copy = storage.copy_file
    copied = []

    def slow_copy(source, target):
        uploading.set()
        release.wait(timeout=30)
        copied.append(Path(target).name)
        return real_copy(source, target)

    monkeypatch.setattr(storage, "copy_file", slow_copy)
    mirror = checkpoint.Mirror(str(mirror_folder), keep=2)
    local = tmp_path / "checkpoints"
    local.mkdir()
    started = time.perf_counter()
    mirror.submit(saved(local, 1))
    # step 1 taken by the uploader before 2 comes (on a loaded machine its thread may start after 2's submit)
    assert uploading.wait(timeout=30)
    for step in (2, 3):
        mirror.submit(saved(local, step))
    assert time.perf_counter() - started < 5  # the store holds every copy until released
    release.set()
    mirror.finish()
    # step 1 was uploading when 2 and 3 came; 2 waited and was replaced by 3, whose upload removed nothing kept
    assert "step-00000002.pt" not in copied
    assert checkpoint.complete(str(mirror_folder)) == ["step-00000001.pt", "step-00000003.pt"]
    assert checkpoint.latest(str(mirror_folder)).endswith("step-00000003.pt")


def test_a_failed_upload_is_raised_at_the_next_submit_or_at_the_end(tmp_path, monkeypatch):
    def failing(source, target):
        raise OSError(f"s3 upload of {target} failed (SlowDown)")

    monkeypatch.setattr(storage, "copy_file", failing)
    local = tmp_path / "checkpoints"
    local.mkdir()
    mirror = checkpoint.Mirror("s3://bucket/run/checkpoints", keep=2)
    mirror.submit(saved(local, 1))
    with pytest.raises(OSError, match="SlowDown"):
        for _ in range(100):  # until the upload has failed
            time.sleep(0.05)
            mirror.submit(saved(local, 2))
    mirror = checkpoint.Mirror("s3://bucket/run/checkpoints", keep=2)
    mirror.submit(saved(local, 3))
    with pytest.raises(OSError, match=r"step-00000003\.pt\.sha256"):
        mirror.finish()
