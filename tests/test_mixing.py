"""Mixing shard sources by weight (train.sources): the samples a run reads come from each source in proportion to
its weight (a red source and a blue one, told apart by the decoded pixels, not by our bookkeeping); a mixed run
killed with SIGKILL and resumed ends bit-identical to an uninterrupted one, loss history included; zero, negative
and non-finite weights, and an empty source, are refused by name."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from kept_ring import KeptRing
from PIL import Image
from safetensors.torch import load_file

from cloob_core.cli import main
from cloob_core.config import ConfigError, load_config
from cloob_core.training.images import TrainImages
from cloob_core.training.streams import StreamChunks, StreamSettings, StreamStart, mixed_streams


def _source(folder: Path, colour: tuple[int, int, int], shards: int = 8, per_shard: int = 25) -> Path:
    folder.mkdir(parents=True)
    sizes = {}
    for shard in range(shards):
        name = f"{shard:05d}.tar"
        with tarfile.open(folder / name, "w") as tar:
            for i in range(per_shard):
                pixels = io.BytesIO()
                shade = tuple(min(255, c + (i % 7)) for c in colour)
                Image.new("RGB", (24, 24), shade).save(pixels, format="JPEG", quality=95)
                words = f"a {'red' if colour[0] > colour[2] else 'blue'} square number {shard * per_shard + i}"
                for suffix, data in (("jpg", pixels.getvalue()), ("txt", words.encode()), ("json", b"{}")):
                    member = tarfile.TarInfo(f"{folder.name}{shard:03d}{i:04d}.{suffix}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
        sizes[name] = per_shard
    (folder / "sizes.json").write_text(json.dumps(sizes))
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sources")
    return _source(root / "red", (220, 20, 20)), _source(root / "blue", (20, 20, 220))


def test_the_samples_read_come_from_each_source_in_proportion_to_its_weight(sources):
    from cloob_core.data.shard_files import shard_list

    red, blue = sources
    mix = mixed_streams([(str(red), shard_list(str(red))[0], 3.0), (str(blue), shard_list(str(blue))[0], 1.0)], 8)
    assert mix.shares == {str(red): 0.75, str(blue): 0.25}
    settings = StreamSettings(streams=8, chunk_size=5, seed=0, shuffle_buffer=20)
    ring = KeptRing(list(range(8)), settings)
    chunks = iter(StreamChunks(mix.per_stream, settings, StreamStart(list(range(8))), TrainImages(16, augment=False),
                               lambda texts: torch.zeros(len(texts), 4), ring))
    reds = total = 0
    while total < 4000:
        for chunk in next(chunks):
            images, _ = ring.of(chunk)
            red_channel, blue_channel = images[:, 0].float().mean((1, 2)), images[:, 2].float().mean((1, 2))
            reds += int((red_channel > blue_channel).sum())
            total += len(images)
    share, expected = reds / total, 0.75
    half_width = 2.576 * math.sqrt(expected * (1 - expected) / total)  # the binomial 99% interval
    assert abs(share - expected) <= half_width, (share, total)


def _cli(red: Path, blue: Path, output: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cloob_core.cli", "train", "--output", str(output), "--steps", "24",
            "--batch-size", "32", "--data-streams", "8", "--checkpoint-every", "4", "--log-every", "4", "--workers",
            "2", "--no-progress", "--no-tensorboard", "--set",
            f"train.sources=[{{shards: {red}, weight: 3}}, {{shards: {blue}, weight: 1}}]", *extra]


@pytest.mark.slow  # ~35 s, in the slow phase for the default one's budget (docs/development.md)
def test_a_mixed_run_killed_and_resumed_ends_bit_identical(sources, tmp_path):
    red, blue = sources
    whole = subprocess.run(_cli(red, blue, tmp_path / "whole"), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert f"train.sources: {red} 75.0%, {blue} 25.0% of every batch" in whole.stderr
    metrics = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    assert metrics["source_shares"] == {str(red): 0.75, str(blue): 0.25}
    assert metrics["source_samples"] == {str(red): 576, str(blue): 192}
    info = json.loads((tmp_path / "whole" / "model" / "model_info.json").read_text())
    assert info["source_shares"] == metrics["source_shares"]  # the model carries what it was trained on
    run = subprocess.Popen(_cli(red, blue, tmp_path / "killed"), start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (tmp_path / "killed" / "checkpoints" / "step-00000012.pt.sha256").exists():
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    resumed = subprocess.run([sys.executable, "-m", "cloob_core.cli", "train", "--output", str(tmp_path / "killed"),
                              "--resume", "latest", "--no-progress"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    one, two = (load_file(tmp_path / name / "model" / "open_clip_model.safetensors") for name in ("whole", "killed"))
    assert all(torch.equal(one[key], two[key]) for key in one)
    history = [(tmp_path / name / "loss_history.csv").read_text() for name in ("whole", "killed")]
    assert history[0] == history[1]


@pytest.mark.parametrize("weight", ["0", "-1", ".inf", ".nan"])
def test_a_weight_that_is_not_positive_and_finite_is_refused(weight):
    with pytest.raises(ConfigError, match=r"train\.sources\.0\.weight"):
        load_config(overrides=[f"train.sources=[{{shards: a, weight: {weight}}}]"])


def test_an_empty_source_is_refused_by_name(sources, tmp_path, capsys):
    red, _ = sources
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--output", str(tmp_path / "run"), "--steps", "2", "--no-progress", "--set",
                 f"train.sources=[{{shards: {red}}}, {{shards: {empty}}}]"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"train.sources[1] {empty}: no sizes.json and no .tar shards" in line


def test_the_report_describes_the_model_with_each_training_sources_share(tmp_path, capsys):
    from cloob_core.evaluation.records import benchmark_record, write_result

    results, model = tmp_path / "eval", tmp_path / "model"
    write_result(results, benchmark_record("pets", "cloob-tiny", str(model), "zeroshot_classification",
                                           {"acc1": 0.5}), "m")
    model.mkdir()
    (model / "model_info.json").write_text(json.dumps({"architecture": "cloob-tiny", "objective": "cloob",
                                                      "steps": 24, "source_shares": {"red": 0.75, "blue": 0.25}}))
    assert main(["eval", "report", "--inputs", str(results), "--model", str(model), "--output",
                 str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "report.md").read_text()
    assert "architecture cloob-tiny, objective cloob, steps 24; started from random weights" in page
    assert "| `red` | 75.0% |" in page and "| `blue` | 25.0% |" in page, page
    capsys.readouterr()
    assert main(["eval", "report", "--inputs", str(results), "--model", str(results), "--output",
                 str(tmp_path / "other")]) == 2
    assert "is not a `cloob train` model folder (no model_info.json)" in capsys.readouterr().err
    assert not (tmp_path / "other" / "report.md").exists()
