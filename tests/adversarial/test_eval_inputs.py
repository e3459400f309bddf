"""Evaluation inputs a user meets at night: labels outside the class set, a caption left empty, a tar cut inside a
member, a full disk under the features spool; and the cache's outputs, the same bytes for the same contents."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile import cli

_WRITE_ENTRY = """
import sys, torch
from cloob_core.evaluation.features import Embedded
from cloob_core.io import write_torch
entry = Embedded(torch.ones(3, 4), [0, 1, 2], [["a"], ["b"], ["c"]], {0: "zero"}, 1, "fp32")
write_torch(sys.argv[1], entry.as_saved())
"""


def test_a_features_cache_entry_is_the_same_bytes_in_every_process(tmp_path):
    """Its fields were saved in a frozenset's order, which changes with each process's hash seed: DVC and any
    content-addressed store saw a change where there was none."""
    digests = set()
    for seed in (0, 1):  # seeds under which the set's order differed
        path = tmp_path / f"entry-{seed}.pt"
        subprocess.run([sys.executable, "-c", _WRITE_ENTRY, str(path)], check=True,
                       env={**os.environ, "PYTHONHASHSEED": str(seed)})
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1


@pytest.fixture(scope="module")
def eval_sets(tmp_path_factory):
    """The packaged MNIST test split in CLIP_benchmark's wds layout (10 classes, 1,000 images) in tars of 100 and
    of 500, built once; a test changes a copy (:func:`_eval_set`)."""
    from cloob_core.cli import main

    root = tmp_path_factory.mktemp("eval-sets")
    for size in (100, 500):
        assert main(["data", "eval-set", "--source", "mnist", "--output", str(root / str(size) / "mnist"),
                     "--shard-size", str(size)]) == 0
    return root


def _eval_set(eval_sets, tmp_path, shard_size: int = 100):
    """A copy of the built set in tars of ``shard_size``."""
    import shutil

    return Path(shutil.copytree(eval_sets / str(shard_size) / "mnist", tmp_path / "mnist"))


def _rewrite_member(tar_path, suffix_name: str, data: bytes) -> None:
    """The member ``suffix_name`` of the tar at ``tar_path`` given ``data`` instead."""
    import io
    import tarfile

    with tarfile.open(tar_path) as source:
        members = [(member, source.extractfile(member).read()) for member in source.getmembers()]
    with tarfile.open(tar_path, "w") as target:
        for member, body in members:
            body = data if member.name == suffix_name else body
            member.size = len(body)
            target.addfile(member, io.BytesIO(body))


@pytest.mark.parametrize("label", [b"-1", b"10"])
def test_a_label_outside_the_classes_is_refused_naming_the_sample(capsys, tmp_path, eval_sets, untrained_export,
                                                                  label):
    """A sample labelled -1 in a set of 10 classes was scored as class 9 (Python's negative index): exit 0, 80 of
    80 samples scored. It is refused, naming the sample, before its set is embedded whole."""
    root = _eval_set(eval_sets, tmp_path)
    names = sorted(name for name in _tar_names(root / "test" / "3.tar") if name.endswith(".cls"))
    _rewrite_member(root / "test" / "3.tar", names[7], label)
    done = cli(capsys, "eval", "zeroshot", "--model", untrained_export, "--data", root, "--output",
               tmp_path / "out", "--no-cache", "--no-progress", "--workers", "2")
    line = done.error_line()
    assert done.code == 2, line
    assert f"{root / 'test' / '3.tar'} sample 7 has label {label.decode()}, outside the 10 classes 0-9" in line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.json"))


def _tar_names(path):
    import tarfile

    with tarfile.open(path) as archive:
        return archive.getnames()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tar_cut_inside_an_image_is_one_warning_counting_the_samples_it_lost(capsys, caplog, tmp_path, eval_sets,
                                                                              untrained_export, workers):
    """It was counted as 3 unreadable samples (webdataset's two reports of the break, and the sample it cut) and
    warned twice; the 399 samples after the cut went uncounted."""
    import tarfile

    root = _eval_set(eval_sets, tmp_path, shard_size=500)
    tar = root / "test" / "0.tar"
    with tarfile.open(tar) as archive:
        image = [member for member in archive.getmembers() if member.name.endswith(".png")][100]
    tar.write_bytes(tar.read_bytes()[: image.offset_data + image.size // 2])
    done = cli(capsys, "eval", "zeroshot", "--model", untrained_export, "--data", root, "--output", tmp_path / "out",
               "--no-cache", "--no-progress", "--workers", workers)
    assert done.code == 0, done.err
    warned = [r.getMessage() for r in caplog.records if "skipping unreadable data" in r.getMessage()]
    assert len(warned) == 1 and f"{tar}: 400 of its 500 samples lost after sample 100" in warned[0], warned
    record = json.loads((tmp_path / "out" / "mnist-test_zeroshot_classification.json").read_text())
    assert record["metrics"]["skipped_unreadable"] == 400
    assert sum(map(sum, record["metrics"]["confusion_matrix"])) == 600


def test_a_full_disk_under_the_features_spool_names_its_folder(capsys, tmp_path, eval_sets, untrained_export,
                                                              small_disk):
    """It said `no space left on device` with no path, where docs/reliability.md promises one."""
    cache = small_disk(32 * 1024)  # the spool of 1,000 features needs more
    root = _eval_set(eval_sets, tmp_path, shard_size=500)
    done = cli(capsys, "eval", "zeroshot", "--model", untrained_export, "--data", root, "--output", tmp_path / "out",
               "--cache", cache, "--no-progress", "--workers", "0")
    line = done.error_line()
    assert done.code == 2, line
    assert line.startswith(f"cloob: no space left on device writing {cache}/ (the features spool"), line


@pytest.mark.parametrize("caption", [b"", b" \n"])
def test_a_retrieval_set_with_one_empty_caption_leaves_that_image_out_and_counts_it(capsys, tmp_path,
                                                                                   untrained_export, caption):
    """The whole set was refused ("this task needs captions"), naming no sample, though 503 others had captions;
    a blank caption was ranked as a query."""
    from cloob_core.cli import main

    root = tmp_path / "captioned"
    assert main(["data", "eval-set", "--source", "captioned", "--type", "retrieval", "--output", str(root)]) == 0
    tar = root / "test" / "0.tar"
    _rewrite_member(tar, sorted(name for name in _tar_names(tar) if name.endswith(".txt"))[5], caption)
    done = cli(capsys, "eval", "retrieval", "--model", untrained_export, "--data", root, "--output", tmp_path / "out",
               "--no-cache", "--no-progress", "--workers", "0")
    assert done.code == 0, done.err
    record = json.loads((tmp_path / "out" / "captioned-test_zeroshot_retrieval.json").read_text())
    total = sum(json.loads((root / "test" / "sizes.json").read_text()).values())
    assert record["metrics"]["uncaptioned_left_out"] == 1 and record["metrics"]["images"] == total - 1
    assert record["warnings"] == ["1 image(s) without a caption left out"]
