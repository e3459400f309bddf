"""Evaluation while training (train.eval_every): the final weights are bit-identical with and without it, on one
process and on 2 gloo ranks; the figures at step N are those of `cloob eval suite --checkpoint` on step N's
checkpoint; they reach TensorBoard, Prometheus and eval_history.csv; an evaluation that fails is reported and the
run goes on."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from cloob_core.cli import main

EVAL = ["--set", "train.eval_datasets=[captioned]"]  # retrieval and diagnostics on the captioned set's test split


def _cli(shards: Path, output: Path, *extra: str) -> list[str]:
    return ["train", "--shards", str(shards), "--output", str(output), "--steps", "8", "--batch-size", "32",
            "--data-streams", "4", "--workers", "0", "--checkpoint-every", "4", "--log-every", "4", "--no-progress",
            "--set", "model.architecture=cloob-tiny-vit", *extra]


def _weights(output: Path) -> dict:
    return load_file(output / "model" / "open_clip_model.safetensors")


def _same(one: dict, two: dict) -> bool:
    return set(one) == set(two) and all(bool((one[key] == two[key]).all()) for key in one)


@pytest.fixture(scope="module")
def runs(mnist_train_shards, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-while-training")
    assert main(_cli(mnist_train_shards, root / "plain")) == 0
    assert main(_cli(mnist_train_shards, root / "evaluated", "--eval-every", "4", *EVAL)) == 0
    return root


def test_the_weights_are_the_same_with_and_without_evaluation(runs):
    root = runs
    assert _same(_weights(root / "plain"), _weights(root / "evaluated"))
    plain, evaluated = ((root / name / "loss_history.csv").read_text() for name in ("plain", "evaluated"))
    assert plain == evaluated


def test_the_figures_at_a_step_are_cloob_evals_on_its_checkpoint(runs, tmp_path):
    root = runs
    checkpoint = root / "evaluated" / "checkpoints" / "step-00000004.pt"
    assert main(["eval", "suite", "--checkpoint", str(checkpoint), "--dataset", "captioned", "--output",
                 str(tmp_path / "by-hand"), "--no-progress"]) == 0
    by_hand = json.loads((tmp_path / "by-hand" / "captioned" / "metrics.json").read_text())
    during = json.loads((root / "evaluated" / "evals" / "step-00000004" / "results" / "captioned" /
                         "metrics.json").read_text())
    assert by_hand == during and by_hand["captioned_zeroshot_retrieval"]["image_retrieval_recall@5"] >= 0


def test_the_scalars_reach_tensorboard_and_the_plots_file(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = runs
    with (root / "evaluated" / "eval_history.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["step"] for row in rows] == ["4", "8"]
    assert float(rows[0]["captioned_zeroshot_retrieval.image_retrieval_recall@5"]) >= 0
    events = EventAccumulator(str(root / "evaluated" / "tensorboard")).Reload()
    points = events.Scalars("eval/captioned_zeroshot_retrieval.image_retrieval_recall@5")
    assert [point.step for point in points] == [4, 8]
    assert float(rows[1]["captioned_zeroshot_retrieval.image_retrieval_recall@5"]) == pytest.approx(points[1].value)


def test_a_failing_evaluation_is_reported_and_the_run_goes_on(mnist_train_shards, tmp_path, caplog):
    import logging

    import yaml

    caplog.set_level(logging.WARNING)
    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    params["eval"]["datasets"]["broken"] = {"source": str(tmp_path / "nowhere"), "tasks": ["zeroshot"]}
    params["train"].pop("shards")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    assert main(_cli(mnist_train_shards, tmp_path / "run", "--params", str(tmp_path / "params.yaml"),
                     "--eval-every", "4", "--set", "train.eval_datasets=[broken]")) == 0
    assert "evaluation of step 4 failed (exit 2)" in caplog.text and "the run goes on" in caplog.text
    assert (tmp_path / "run" / "model" / "open_clip_model.safetensors").exists()


def test_two_gloo_ranks_train_the_same_weights_with_and_without_evaluation(mnist_train_shards, tmp_path,
                                                                           pushgateway):
    address, received = pushgateway
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                "cloob_core.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, extra in (("plain", []), ("evaluated", ["--eval-every", "4", "--pushgateway", address, *EVAL])):
        done = subprocess.run([*launcher, *_cli(mnist_train_shards, tmp_path / name, *extra)], capture_output=True,
                              text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    assert _same(_weights(tmp_path / "plain"), _weights(tmp_path / "evaluated"))
    assert (tmp_path / "evaluated" / "evals" / "step-00000008" / "results" / "captioned" / "metrics.json").exists()
    bodies = "\n".join(body for _, body in received)  # rank 0's Prometheus metrics, pushed
    assert 'cloob_train_eval{metric="captioned_zeroshot_retrieval.image_retrieval_recall@5"}' in bodies
    assert "cloob_train_eval_step 8.0" in bodies
