"""The validation gate (Great Expectations), local and packaged shards and the training reader."""

from __future__ import annotations

import io
import itertools
import json
import logging
import tarfile

import numpy as np
import pytest
import torch
from image_server import photo_bytes
from kept_ring import KeptRing

from cloob_core.cli import main
from cloob_core.config import load_config
from cloob_core.data.local import build_shards
from cloob_core.data.shard_files import shard_list
from cloob_core.data.validate import run_gate
from cloob_core.training.images import TrainImages
from cloob_core.training.streams import StreamChunks, StreamSettings, StreamStart


@pytest.fixture(scope="module")
def mnist_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("mnist") / "shards"
    config = load_config(overrides=["preprocess.resize_mode=no", "preprocess.shard_size=400"])
    summary = build_shards("mnist", str(out), config, split="test", progress=False)
    return out, summary


def test_a_packaged_set_becomes_shards_with_labels(mnist_shards, read_shards):
    out, summary = mnist_shards
    assert summary.stats["successes"] == 1000 and summary.sizes == {"00000.tar": 400, "00001.tar": 400,
                                                                    "00002.tar": 200}
    assert shard_list(str(out)) == ([str(out / f"0000{i}.tar") for i in range(3)], 1000)
    samples = read_shards(str(out))
    assert len(samples) == 1000
    image, caption, meta = samples[0]
    label, classname = meta["label"], meta["classname"]
    assert image.shape == (28, 28, 3) and classname == str(label)
    from cloob_core.data.mnist import load_mnist

    held_out = load_mnist("test")
    assert caption == held_out.captions[0] and label == held_out.labels[0]
    difference = np.abs(image[..., 0].astype(int) - held_out.images[0].astype(int))
    assert difference.mean() < 2.0 and difference.max() < 64  # the same digit, through JPEG at quality 95


def test_gate_passes_good_shards_and_fails_inconsistent_ones(mnist_shards, tmp_path, capsys):
    out, _ = mnist_shards
    assert main(["data", "validate", "--shards", str(out), "--report", str(tmp_path / "report")]) == 0
    assert "data gate PASSED" in capsys.readouterr().out
    results = json.loads((tmp_path / "report" / "gx_results.json").read_text())
    assert results["shards"]["success"] and results["shard_totals"]["success"]
    # a sizes.json that lies about a shard, and an image-size bound the data breaks
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in out.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    sizes = json.loads((broken / "sizes.json").read_text())
    sizes["00001.tar"] += 5
    (broken / "sizes.json").write_text(json.dumps(sizes))
    # merge-stats published it with the other summary files: an edit is refused by name
    assert main(["data", "validate", "--shards", str(broken)]) == 2
    assert "sizes.json does not match the output published" in capsys.readouterr().err
    (broken / ".cloob-unit.json").unlink()  # a sizes.json written by another tool: the gate checks what it says
    code = main(["data", "validate", "--shards", str(broken), "--min-image-side", "32"])
    text = capsys.readouterr().out
    assert code == 1 and "data gate FAILED: 2 of 15 checks" in text
    assert "FAIL shards: expect_column_pair_values_to_be_equal [sizes_json = tar_samples]" in text
    assert "FAIL shards: expect_column_values_to_be_between [side_min]" in text
    # a tar cut short after the download (a copy gone wrong) is named, not a crash
    with tarfile.open(broken / "00000.tar") as tar:  # cut inside a member's data, not in block padding
        member = tar.getmembers()[4]
        cut = member.offset_data + member.size // 2
    (broken / "00000.tar").write_bytes((broken / "00000.tar").read_bytes()[:cut])
    assert main(["data", "validate", "--shards", str(broken)]) == 1
    text = capsys.readouterr().out
    assert "FAIL shards: expect_column_values_to_be_between [unreadable_tar]" in text


def test_gate_on_manifests(tmp_path, capsys):
    good = tmp_path / "good.csv"
    good.write_text("url,caption\nhttp://example.com/1.jpg,a cat\nhttps://example.com/2.png,a dog\n")
    assert main(["data", "validate", "--manifest", str(good)]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.csv"
    bad.write_text("url,caption\nhttp://example.com/1.jpg,a cat\nftp://example.com/2.png,a dog\n"
                   "http://example.com/1.jpg,again\nhttp://example.com/3.jpg,\n")
    code = main(["data", "validate", "--manifest", str(bad), "--report", str(tmp_path / "r")])
    text = capsys.readouterr().out
    assert code == 1
    # exact counts over every row, by the engine
    assert "FAIL manifest: expect_column_values_to_be_between [bad_url_fraction] {'max_value': 0.0} — 1 row(s) " \
        "break it, e.g. ['ftp://example.com/2.png']" in text
    assert "FAIL manifest: expect_column_values_to_be_between [duplicate_url_fraction] {'max_value': 0.0} — 1 " \
        "row(s) break it, e.g. ['http://example.com/1.jpg']" in text
    assert "FAIL manifest: expect_column_values_to_be_between [empty_caption_fraction] {'max_value': 0.05}" in text
    assert "raise validation.max_empty_caption_fraction to allow more, or check --caption-col" in text
    assert "PASS manifest: expect_column_values_to_be_between [long_caption_fraction]" in text
    # row-level expectations on the sample, here every row
    assert "FAIL manifest_rows: expect_column_values_to_match_regex [url]" in text
    assert "FAIL manifest_rows: expect_column_values_to_be_unique [url] — 2 row(s)" in text
    assert "FAIL manifest_rows: expect_column_values_to_match_regex [caption]" in text
    assert "data gate FAILED" in (tmp_path / "r" / "summary.md").read_text()
    # the same bad rows pass when the configured tolerances allow them
    loose = load_config(overrides=["validation.max_bad_row_fraction=0.5", "validation.max_empty_caption_fraction=0.5"])
    assert run_gate(loose, manifest=str(bad)).passed


def test_a_crawl_with_a_few_empty_captions_passes_the_gate_and_the_download_drops_them(tmp_path, capsys):
    """3 empty captions of 120 rows (issue 79, point 9): the download drops them, so the gate lets them by under
    validation.max_empty_caption_fraction (5%); a URL repeated still fails, its line naming the setting."""
    rows = [f"http://crawl.example/{i}.jpg,{'' if i in (7, 50, 99) else f'a picture {i}'}" for i in range(120)]
    manifest = tmp_path / "crawl.csv"
    manifest.write_text("url,caption\n" + "\n".join(rows) + "\n")
    assert main(["data", "validate", "--manifest", str(manifest)]) == 0, capsys.readouterr().out
    text = capsys.readouterr().out
    assert "PASS manifest: expect_column_values_to_be_between [empty_caption_fraction]" in text
    manifest.write_text("url,caption\n" + "\n".join([*rows, rows[0]]) + "\n")
    assert main(["data", "validate", "--manifest", str(manifest)]) == 1
    text = capsys.readouterr().out
    assert "[duplicate_url_fraction]" in text and "raise validation.max_bad_row_fraction to allow them" in text


def test_folder_with_sidecar_captions(tmp_path, read_shards):
    source = tmp_path / "photos"
    (source / "cats").mkdir(parents=True)
    (source / "dogs").mkdir()
    for index, folder in enumerate(["cats", "cats", "dogs"]):
        (source / folder / f"p{index}.jpg").write_bytes(photo_bytes(index))
        (source / folder / f"p{index}.txt").write_text(f"a photo of {folder} {index}\n")
    (source / "dogs" / "nocaption.jpg").write_bytes(photo_bytes(7))
    config = load_config(overrides=["preprocess.image_size=32"])
    summary = build_shards(str(source), str(tmp_path / "out"), config, progress=False)
    assert summary.stats["successes"] == 3 and summary.stats["failures_by_reason"] == {"empty_caption": 1}
    samples = read_shards(str(tmp_path / "out"))
    assert [(c, meta["classname"]) for _, c, meta in samples] == [
        ("a photo of cats 0", "cats"), ("a photo of cats 1", "cats"), ("a photo of dogs 2", "dogs")]


def test_manifest_of_paths_cannot_escape_its_folder(tmp_path):
    source = tmp_path / "images"
    source.mkdir()
    (source / "ok.jpg").write_bytes(photo_bytes(1))
    (tmp_path / "secret.jpg").write_bytes(photo_bytes(2))
    manifest = source / "m.csv"  # its relative paths are read from its own folder
    manifest.write_text("url,caption\nok.jpg,fine\n../secret.jpg,escape\n/etc/hostname,absolute\nmissing.jpg,x\n")
    summary = build_shards(str(source), str(tmp_path / "out"),
                           load_config(overrides=["validation.min_success_ratio=0"]), manifest=str(manifest),
                           progress=False)
    assert summary.stats["successes"] == 1
    assert summary.stats["failures_by_reason"] == {"blocked_path": 2, "missing_file": 1}


def test_the_training_reader_skips_corrupt_samples_and_tars_with_a_count(mnist_shards, tmp_path, caplog):
    out, _ = mnist_shards
    good = out / "00002.tar"
    with tarfile.open(good) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    corrupt = tmp_path / "corrupt.tar"
    with tarfile.open(corrupt, "w") as tar:
        for index, (member, data) in enumerate(members[:30]):  # 10 samples
            if index == 0:
                data = b"\xff\xd8\xff not a jpeg"  # sample 0: corrupt image
            if index == 5:
                continue  # sample 1: no caption
            member.size = len(data)
            import io

            tar.addfile(member, io.BytesIO(data))
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(good.read_bytes()[: 20 * 1024 + 100])
    settings = StreamSettings(streams=1, chunk_size=1, seed=0, shuffle_buffer=0)
    ring = KeptRing([0], settings)
    stream = StreamChunks([[str(corrupt), str(truncated)]], settings, StreamStart([0]), TrainImages(28, augment=False),
                          lambda texts: torch.zeros(len(texts), 4), ring)
    with caplog.at_level(logging.WARNING, logger="cloob_core.data.shard_files"):
        chunks = itertools.chain.from_iterable(stream)  # one item per step: the chunks of the worker's streams
        first_pass = list(itertools.takewhile(lambda chunk: chunk.position[0] == 0, chunks))
    assert sum(chunk.skipped for chunk in first_pass) == 2  # the bad image, the caption-less sample
    assert sum("skipping unreadable data" in record.getMessage() for record in caplog.records) >= 3  # + the cut
    assert 8 <= len(first_pass) < 10 + 200
    assert all(ring.of(chunk)[0].shape == (1, 3, 28, 28) for chunk in first_pass)


def test_the_sample_cache_changes_nothing_in_the_stream_and_serves_later_passes_from_memory(mnist_shards, tmp_path):
    """Three passes over a shard with a corrupt image and a caption-less sample, a good shard and a truncated one,
    with random crops and a shuffle buffer: the same chunks with the cache as without. After the first pass the
    good and the corrupt shards' tars are moved away, and the cached stream goes on as if they were there."""
    import shutil

    out, _ = mnist_shards
    with tarfile.open(out / "00002.tar") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    corrupt = tmp_path / "corrupt.tar"
    with tarfile.open(corrupt, "w") as tar:
        for index, (member, data) in enumerate(members[:30]):
            if index == 0:
                data = b"\xff\xd8\xff not a jpeg"
            if index == 5:
                continue
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    good = tmp_path / "good.tar"
    shutil.copy(out / "00001.tar", good)
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes((out / "00000.tar").read_bytes()[: 20 * 1024 + 100])

    def stream(cache_bytes: int) -> StreamChunks:
        settings = StreamSettings(streams=1, chunk_size=8, seed=3, shuffle_buffer=50, cache_bytes=cache_bytes)
        return StreamChunks([[str(corrupt), str(good), str(truncated)]], settings, StreamStart([0]), TrainImages(16),
                            lambda texts: torch.tensor([[len(t), sum(t.encode())] for t in texts]),
                            KeptRing([0], settings))

    uncached = stream(0)
    expected = list(itertools.takewhile(lambda chunk: chunk.position[0] < 3, itertools.chain.from_iterable(uncached)))
    cached = stream(1 << 30)
    for index, chunk in enumerate(itertools.takewhile(lambda chunk: chunk.position[0] < 3,
                                                      itertools.chain.from_iterable(cached))):
        reference = expected[index]
        assert (chunk.step, chunk.position, chunk.skipped) == (reference.step, reference.position, reference.skipped)
        (images, tokens), (reference_images, reference_tokens) = cached.ring.of(chunk), uncached.ring.of(reference)
        assert torch.equal(images, reference_images) and torch.equal(tokens, reference_tokens)
        if chunk.position[0] == 1 and good.exists():
            good.rename(tmp_path / "moved.tar")
            corrupt.rename(tmp_path / "moved-corrupt.tar")  # its bad image is not a bad tar: kept too
    assert index == len(expected) - 1 and not good.exists() and not corrupt.exists()
    # each pass: the bad image, the caption-less sample and the truncated tar's cut sample (no caption)
    assert sum(chunk.skipped for chunk in expected) == 3 * 3
    assert 28 * 28 * 3 * 400 < cached.cache.used < 2 << 20  # the good shard's 400 decoded images and the rest


@pytest.mark.parametrize("stage", ["download", "validate", "shards", "merge-stats"])
def test_every_data_stage_documents_its_options(stage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", stage, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: cloob data " + stage in text
    if stage == "download":
        for flag in ("--manifest", "--output", "--url-col", "--caption-col", "--allow-private-network",
                     "--retry-failed", "--partition", "--resize-mode", "--url-deadline", "--max-image-pixels"):
            assert flag in text


def test_too_few_shards_for_trainings_data_streams_are_named_with_the_size_that_gives_enough(tmp_path, capsys):
    common = ["data", "shards", "--source", "mnist", "--split", "test", "--no-progress", "--resize-mode", "no"]
    assert main([*common, "--output", str(tmp_path / "few"), "--shard-size", "400"]) == 0
    out = capsys.readouterr().out
    assert "warning: 3 shard(s) feed at most 3 training data stream(s)" in out, out
    assert "preprocess.shard_size at most 125 (--shard-size 125)" in out
    assert main([*common, "--output", str(tmp_path / "enough"), "--shard-size", "125"]) == 0
    out = capsys.readouterr().out
    assert "shards 8" in out and "warning" not in out


def test_data_shards_reads_a_manifests_own_column_names_as_acquire_does(tmp_path, capsys):
    source = tmp_path / "images"
    source.mkdir()
    for i in range(3):
        (source / f"{i}.jpg").write_bytes(photo_bytes(i))
    manifest = tmp_path / "captions.csv"
    manifest.write_text("file,text\nimages/0.jpg,a red thing\nimages/1.jpg,a blue thing\nimages/2.jpg,a green thing\n")
    assert main(["data", "shards", "--source", str(source), "--manifest", str(manifest), "--output",
                 str(tmp_path / "out"), "--url-col", "file", "--caption-col", "text", "--no-progress"]) == 0
    assert "samples written 3 (100.0%)" in capsys.readouterr().out


def test_a_folder_of_images_without_captions_fails_naming_what_to_give(tmp_path, capsys):
    source = tmp_path / "images"
    source.mkdir()
    for i in range(4):
        (source / f"{i}.jpg").write_bytes(photo_bytes(i))
    assert main(["data", "shards", "--source", str(source), "--output", str(tmp_path / "out"), "--no-progress"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "0 of 4 rows became samples" in line and "4 failed as empty_caption" in line and "IMAGE.txt" in line
