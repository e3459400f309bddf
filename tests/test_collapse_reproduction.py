"""The CPU reproduction of CLOOB's collapse (docs/objectives.md, "Collapse"): `cloob-tiny-vit-w256`, a 2-layer ViT
whose towers are 256 wide and start, like ViT-B-32's, in a narrow cone, trained at batch 64 for 60 steps on the
captioned set with the defaults otherwise (the 200 warm-up steps cut to 30). The paper's recipe, CLOOB with
Hopfield retrieval from the first step, sits at its collapsed value from about step 30 while CLIP learns; the
default starts without Hopfield retrieval for the warm-up and until a batch has left the collapsed value, and CLOOB
learns. The detector names the collapse
within its windows, and `train.on_collapse: stop` ends such a run with exit 2 after a checkpoint."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import forked
import pytest

pytestmark = pytest.mark.slow

REPRODUCTION = ["--architecture", "cloob-tiny-vit-w256", "--batch-size", "64", "--steps", "60", "--log-every", "10",
                "--checkpoint-every", "1000", "--no-progress", "--no-tensorboard", "--seed", "0"]
PAPERS_START = ["--set", "objective.start_without_hopfield=0"]  # the recipe before: Hopfield from the first step


def train(shards: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    """`cloob train` in a process of its own (forked: tests/forked.py), for its exit status and stderr."""
    argv = ["train", "--shards", shards, "--output", output, *REPRODUCTION, *extra]
    process = forked.start(argv)
    out, err = process.communicate(timeout=900)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def margin_share(metrics: dict) -> float:
    """How far below its collapsed value the final window's loss is, as a share of that value."""
    return metrics["collapse_margin"] / metrics["collapsed_loss"]


def test_the_default_recipe_learns_where_the_papers_start_collapses(captioned_train_shards, tmp_path):
    """Fails on the code before the fix (its default was the paper's start), passes after it."""
    runs = {}
    for name, extra in (("default", ()), ("clip", ("--objective", "clip"))):
        done = train(captioned_train_shards, tmp_path / name, *extra)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "training has collapsed" not in done.stderr
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert runs["default"]["objective"] == "cloob"
    collapsed = {"default": 2 * math.log(63) / 30, "clip": math.log(64)}  # batch 64, inv_tau 30
    for name, metrics in runs.items():  # well below the collapsed value (the code before: cloob's loss 0.2762)
        assert (collapsed[name] - metrics["final_loss"]) / collapsed[name] > 0.02, (name, metrics["final_loss"])
    for name, metrics in runs.items():
        assert metrics["collapsed_loss"] == pytest.approx(collapsed[name], abs=1e-6)
        assert metrics["collapse_detected_at_step"] is None, name
        assert max(metrics["mean_cosine_image"], metrics["mean_cosine_text"]) < 0.98, (name, metrics)


def test_the_papers_start_collapses_and_the_detector_says_so_within_its_windows(captioned_train_shards, tmp_path):
    done = train(captioned_train_shards, tmp_path / "run", *PAPERS_START)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "training has collapsed" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "collapsed value 0.2762" in lines[0] and "lower optim.lr" in lines[0]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["collapse_detected_at_step"] <= 50  # 3 windows of 10 steps after the loss reached it at 30
    assert abs(margin_share(metrics)) < 0.001 and max(metrics["mean_cosine_image"], metrics["mean_cosine_text"]) > 0.98
    history = (tmp_path / "run" / "loss_history.csv").read_text().splitlines()
    assert history[0].startswith("step,loss,lr,collapsed_loss,collapse_margin,effective_rank_image")
    assert len(history) == 7 and all(len(row.split(",")) == 9 for row in history)


def test_on_collapse_stop_checkpoints_and_exits_2_with_the_line(captioned_train_shards, tmp_path):
    done = train(captioned_train_shards, tmp_path / "run", *PAPERS_START, "--set", "train.on_collapse=stop")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cloob: stopped at step ") and "(train.on_collapse: stop; checkpoint" in last
    assert "training has collapsed" in last and "Traceback" not in done.stderr
    step = int(last.split("stopped at step ")[1].split(" ")[0])
    assert step <= 50 and (tmp_path / "run" / "checkpoints" / f"step-{step:08d}.pt").exists()
    assert not (tmp_path / "run" / "model").exists()
    # resumed (by hand, by dvc repro's --resume auto, by a retried pod), it stops again before a step, saying so;
    # it had exited 0 and exported the collapsed model without a word
    for resume in ("latest", "auto"):
        again = train(captioned_train_shards, tmp_path / "run", *PAPERS_START, "--set", "train.on_collapse=stop",
                      "--resume", resume)
        assert again.returncode == 2, again.stderr[-2000:]
        line = again.stderr.strip().splitlines()[-1]
        assert f"collapsed at step {step} and train.on_collapse: stop ended it" in line, line
        assert "--set train.on_collapse=warn" in line and not (tmp_path / "run" / "model").exists()
    told = train(captioned_train_shards, tmp_path / "run", *PAPERS_START, "--set", "train.on_collapse=warn",
                 "--resume", "latest")
    assert told.returncode == 0, told.stderr[-2000:]
    assert f"collapsed at step {step} (train.on_collapse: warn): training on" in told.stderr
