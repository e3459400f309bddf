"""Training refuses a shard set that merge-stats found incomplete unless asked, and a later run of a stage removes
what killed runs of it left behind: staging folders in TMPDIR, probe objects in the promotion store."""

from __future__ import annotations

import shutil
import time

from hostile import cli
from killing import killed_at, run

from cloob_core import conditional_write, storage


def test_training_on_shards_that_merge_stats_found_incomplete_is_refused_unless_asked(capsys, tmp_path,
                                                                                      mnist_train_shards):
    shards = tmp_path / "shards"
    shutil.copytree(mnist_train_shards, shards)
    for path in shards.glob("00015[._]*"):  # a partition is still writing its last shard
        path.unlink()
    done = cli(capsys, "data", "merge-stats", "--output", shards)
    assert done.code == 0 and "INCOMPLETE: 1 of 16 shards are missing" in done.out
    train = ["train", "--shards", shards, "--output", tmp_path / "run", "--steps", "1", "--set", "train.batch_size=8",
             "--set", "train.data_streams=1", "--set", "train.workers=0"]
    refused = cli(capsys, *train)
    line = refused.error_line()
    assert refused.code == 2 and "1 of 16 shards are missing" in line and "train.allow_incomplete_shards" in line
    assert not (tmp_path / "run" / "checkpoints").exists()
    asked = cli(capsys, *train, "--set", "train.allow_incomplete_shards=true")
    assert asked.code == 0, asked.err


def test_a_killed_acquire_leaves_its_staging_folder_and_the_next_one_removes_it(tmp_path):
    scratch_dir = tmp_path / "tmp"
    scratch_dir.mkdir()
    source = tmp_path / "m.csv"
    source.write_text("url,caption\n" + "".join(f"http://example.com/{i}.jpg,c {i}\n" for i in range(50)))
    argv = ["data", "acquire", "--source", source, "--output", tmp_path / "out"]
    env = {"TMPDIR": str(scratch_dir)}
    killed_at(argv, tmp_path / "moments", 1, env=env)  # before its first write: the part is staged in TMPDIR
    left = [path.name for path in scratch_dir.iterdir() if path.name.startswith("cloob-acquire-")]
    assert left, list(scratch_dir.iterdir())
    other = scratch_dir / "cloob-acquire-0000aaaa-1-someone-elses"  # another machine's: never touched
    other.mkdir()
    assert run(argv, tmp_path / "moments", env=env).code == 0
    assert sorted(path.name for path in scratch_dir.iterdir()) == [other.name]


def test_probe_objects_a_killed_gate_left_are_removed_by_a_later_gate(s3_bucket, monkeypatch):
    store = f"s3://{s3_bucket}/registry"
    abandoned = storage.join(store, ".cas-probe", "left-by-a-killed-gate")
    storage.write_bytes(abandoned, b"x")
    monkeypatch.setattr(conditional_write, "PROBE_ABANDONED_S", 1.0)
    assert conditional_write.honours_conditional_writes(store)
    assert storage.exists(abandoned)  # seconds old: it may be a running gate's
    time.sleep(2.1)  # S3 times have whole seconds
    assert conditional_write.honours_conditional_writes(store)
    assert not storage.exists(abandoned) and not storage.exists(storage.join(store, ".cas-probe"))  # nor ours
