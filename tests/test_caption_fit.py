"""How captions fit the model's text context (cloob_core.data.caption_fit): counted with the model's own tokenizer,
judged by the validation thresholds in the data gate and before training's first step. The case the thresholds
exist for: captions that share a long prefix become one token sequence when cut, and a run trains on nothing."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import pytest

from cloob_core.cli import main
from cloob_core.config import load_config
from cloob_core.data.caption_fit import CaptionsDoNotFit, check, measure
from cloob_core.model.dual_encoder import build_tokenizer

BOILERPLATE = "Acme Corporation spring catalogue 2026, page after page of fine goods for the home: "


def test_a_caption_is_cut_exactly_when_its_tokens_pass_the_context():
    tokenizer = build_tokenizer("cloob-tiny")
    context = tokenizer.context_length  # 16: the start and end tokens and 14 of the caption
    fits, cut = "dog " * (context - 2), "dog " * (context - 1)
    assert len(tokenizer.encoder) and tokenizer.encode(fits.strip()) == [tokenizer.encoder["dog</w>"]] * (context - 2)
    fit = measure([fits, cut, "a dog.", cut], "cloob-tiny")
    assert (fit.context, fit.sampled, fit.truncated, fit.distinct) == (16, 4, 2, 3)
    assert fit.truncated_fraction == 0.5
    assert fit.merged == 2  # 15 dogs cut to 14 are the 14 dogs: two distinct captions, one token sequence
    assert measure([fits], "RN50").context == 77  # each architecture's own context


def test_distinct_captions_made_identical_by_the_cut_are_counted():
    products = [f"{BOILERPLATE}item {i}" for i in range(40)]
    fit = measure([*products, "a red bicycle."], "cloob-tiny")
    assert fit.distinct == 41 and fit.merged == 40 and fit.merged_fraction == pytest.approx(40 / 41)
    assert fit.merged_examples and all(example.startswith("Acme") for example in fit.merged_examples)
    # The same words with the product first stay apart: only what the cut makes identical counts.
    assert measure([f"item {i}: {BOILERPLATE}" for i in range(40)], "cloob-tiny").merged == 0
    assert measure(products, "RN50").merged == 0  # a 77-token context keeps them apart


def test_thresholds_refuse_in_one_line_naming_the_setting(caplog):
    products = [f"{BOILERPLATE}item {i}" for i in range(40)]
    config = load_config(overrides=["validation.max_truncated_caption_fraction=1.0"])
    with pytest.raises(CaptionsDoNotFit, match=r"makes 100\.0% of the 40 distinct ones sampled identical") as err:
        check(products, config)
    assert "validation.max_merged_caption_fraction 0.05" in str(err.value) and "\n" not in str(err.value)
    long = [f"thing {i} " + "very " * 20 for i in range(10)] + ["a cat."] * 10  # cut, but apart
    with pytest.raises(CaptionsDoNotFit, match=r"validation\.max_truncated_caption_fraction 0\.4"):
        check(long, load_config(overrides=["validation.max_truncated_caption_fraction=0.4"]))
    caplog.set_level("WARNING")
    check(long, load_config())  # 50%: not above the default 0.5, but above the warning's 0.1
    assert "50.0% of sampled captions are cut to cloob-tiny's 16-token context" in caplog.text


def _manifest(path: Path, captions: list[str]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["url", "caption"])
        writer.writerows([f"http://images.example/{i}.jpg", caption] for i, caption in enumerate(captions))
    return path


def test_the_manifest_gate_fails_on_merged_captions_and_names_the_setting(tmp_path, capsys):
    products = _manifest(tmp_path / "products.csv", [f"{BOILERPLATE}item {i}" for i in range(50)])
    assert main(["data", "validate", "--manifest", str(products), "--report", str(tmp_path / "report")]) == 1
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if "FAIL manifest_captions" in text and "merged_fraction" in text)
    assert "validation.max_merged_caption_fraction" in line and "model.architecture" in line
    facts = json.loads((tmp_path / "report" / "gx_results.json").read_text())["manifest_captions"]
    assert not facts["success"]
    assert main(["data", "validate", "--manifest", str(products), "--set", "model.architecture=RN50"]) == 0
    assert "data gate PASSED" in capsys.readouterr().out


def _shard(path: Path, captions: list[str]) -> None:
    from PIL import Image

    pixels = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(pixels, format="JPEG")
    with tarfile.open(path, "w") as tar:
        for i, caption in enumerate(captions):
            for suffix, data in (("jpg", pixels.getvalue()), ("txt", caption.encode()), ("json", b"{}")):
                member = tarfile.TarInfo(f"{i:09d}.{suffix}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))


def test_training_refuses_before_its_first_step(tmp_path, capsys):
    for shard in range(2):
        _shard(tmp_path / f"{shard:05d}.tar", [f"{BOILERPLATE}item {shard}-{i}" for i in range(20)])
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 20, "00001.tar": 20}))
    argv = ["train", "--shards", str(tmp_path), "--output", str(tmp_path / "run"), "--steps", "2", "--batch-size",
            "8", "--data-streams", "2", "--workers", "0", "--no-progress", "--no-tensorboard"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "validation.max_merged_caption_fraction" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())
    assert main([*argv, "--set", "validation.max_merged_caption_fraction=1",
                 "--set", "validation.max_truncated_caption_fraction=1"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["caption_truncated_fraction"] == 1.0 and metrics["caption_merged_fraction"] == 1.0


def test_two_ranks_refuse_together_on_rank_zeros_measure(tmp_path):
    """Rank 0 alone reads the captions (once per job, not once per rank); its verdict reaches every rank, so none
    waits in a collective for a rank that stopped."""
    import os
    import subprocess
    import sys

    for shard in range(2):
        _shard(tmp_path / f"{shard:05d}.tar", [f"{BOILERPLATE}item {shard}-{i}" for i in range(20)])
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 20, "00001.tar": 20}))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "cloob_core.cli", "train", "--shards", str(tmp_path), "--output",
                           str(tmp_path / "run"), "--steps", "2", "--batch-size", "8", "--data-streams", "2",
                           "--workers", "0", "--no-progress", "--no-tensorboard"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    refusals = [line for line in done.stderr.splitlines() if "validation.max_merged_caption_fraction" in line]
    assert len(refusals) == 2, done.stderr[-3000:]  # one line from each rank


def test_the_most_common_captions_share_is_measured():
    fit = measure(["a photo."] * 6 + ["a dog.", "a cat."], "cloob-tiny")
    assert (fit.repeated, fit.repeated_caption, fit.distinct) == (6, "a photo.", 3)
    assert fit.top_share == 0.75 and fit.as_dict()["top_caption_share"] == 0.75
    # ten class names, evenly: 0.1, far under the default threshold
    classes = measure([f"a photo of the digit {i % 10}." for i in range(200)], "cloob-tiny")
    assert classes.top_share == pytest.approx(0.1)


@pytest.mark.parametrize("rows", [1, 2, 19])
def test_the_diversity_check_decides_nothing_from_a_sample_too_small_to_measure(tmp_path, capsys, rows):
    """A 1-row manifest failed with "100.0% of 1 sampled captions are the same caption": in a sample of n the top
    share is at least 1/n, whatever the captions."""
    small = _manifest(tmp_path / "small.csv", [f"a photo of the digit {i}." for i in range(rows)])
    assert main(["data", "validate", "--manifest", str(small)]) == 0
    assert "data gate PASSED" in capsys.readouterr().out


def test_the_gate_fails_captions_that_are_one_sentence_and_names_the_setting(tmp_path, capsys):
    same = _manifest(tmp_path / "same.csv", ["an image"] * 40)
    assert main(["data", "validate", "--manifest", str(same)]) == 1
    out = capsys.readouterr().out
    line = next(text for text in out.splitlines() if "FAIL manifest_captions" in text and "top_caption_share" in text)
    assert "validation.max_top_caption_share" in line and "'an image'" in line and "1 distinct" in line
    varied = _manifest(tmp_path / "varied.csv", [f"a photo of the digit {i % 10}." for i in range(40)])
    assert main(["data", "validate", "--manifest", str(varied)]) == 0
    assert "data gate PASSED" in capsys.readouterr().out
    # the shard gate measures the decoded samples' captions alike: shards `cloob data shards` built from a folder
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for i in range(24):
        Image.new("RGB", (32, 32), (10 * i, 100, 200 - 5 * i)).save(images / f"{i:03d}.jpg")
        (images / f"{i:03d}.txt").write_text("an image")
    assert main(["data", "shards", "--source", str(images), "--output", str(tmp_path / "shards"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["data", "validate", "--shards", str(tmp_path / "shards")]) == 1
    assert any("FAIL shard_captions" in text and "validation.max_top_caption_share" in text
               for text in capsys.readouterr().out.splitlines())


def test_training_on_one_repeated_caption_warns(tmp_path, caplog):
    import logging

    caplog.set_level(logging.WARNING)
    for shard in range(2):
        _shard(tmp_path / f"{shard:05d}.tar", ["an image"] * 20)
    (tmp_path / "sizes.json").write_text(json.dumps({"00000.tar": 20, "00001.tar": 20}))
    assert main(["train", "--shards", str(tmp_path), "--output", str(tmp_path / "run"), "--steps", "1",
                 "--batch-size", "8", "--data-streams", "2", "--workers", "0", "--no-progress",
                 "--no-tensorboard"]) == 0
    warned = [record.getMessage() for record in caplog.records if "max_top_caption_share" in record.getMessage()]
    assert len(warned) == 1 and ("100.0% of 40 sampled captions (the check decides from 20 or more) are the same "
                                 "caption ('an image'") in warned[0]
