"""The diagnostics over training: each checkpoint evaluated as the model it was, the last one agreeing with the
exported model's `cloob eval diagnostics`, and the paper's relative change measured against a reference step."""

from __future__ import annotations

import pytest

from cloob_core.config import load_config
from cloob_core.evaluation.features import Encoding
from cloob_core.evaluation.inputs import load_images
from cloob_core.evaluation.tasks.diagnostics import diagnostics
from cloob_core.evaluation.trajectory import (
    TrajectoryPoint,
    diagnostics_over_training,
    relative_change,
    run_checkpoints,
)
from cloob_core.model.source import ModelSource, load_model
from cloob_core.training.loop import train


@pytest.fixture(scope="module")
def run(mnist_train_shards, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trajectory") / "run"
    config = load_config(overrides=[f"train.shards={mnist_train_shards}", "train.steps=6", "train.batch_size=64",
                                    "train.checkpoint_every=2", "train.keep_checkpoints=10",
                                    "train.tensorboard=false"])
    train(config, folder, progress=False)
    return folder


def test_each_checkpoint_is_evaluated_and_the_last_equals_the_exported_model(run, tmp_path):
    checkpoints = run_checkpoints(run)
    images = load_images("mnist", "test")
    encoding = Encoding(progress=False)
    points = diagnostics_over_training(checkpoints, images, encoding)
    assert [point.step for point in points] == [2, 4, 6]
    dimension = len(points[0].metrics["spectrum_image"])
    for point in points:
        assert 1 <= point.metrics["effective_eigenvalues_image"] <= dimension
        assert 0 < point.metrics["positive_probability_p1"] < 1
    assert points[0].metrics != points[-1].metrics  # the weights moved between checkpoints
    exported = diagnostics(load_model(ModelSource(model=str(run / "model"))), images, tmp_path, encoding)
    for key in ("effective_eigenvalues_image", "effective_eigenvalues_text", "ajne_image",
                "positive_probability_p1"):
        assert points[-1].metrics[key] == pytest.approx(exported[key], rel=1e-5), key


def test_relative_change_is_against_the_reference_step():
    points = [TrajectoryPoint(step, {"effective_eigenvalues_image": value})
              for step, value in ((10, 20), (20, 25), (30, 30))]
    changes = relative_change(points, "effective_eigenvalues_image", 20)
    assert [step for step, _ in changes] == [10, 20, 30]
    assert [change for _, change in changes] == pytest.approx([-0.2, 0.0, 0.2])
    with pytest.raises(ValueError, match="no checkpoint at the reference step 15"):
        relative_change(points, "effective_eigenvalues_image", 15)


def test_a_run_without_checkpoints_is_one_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoints"):
        run_checkpoints(tmp_path)


def test_cloob_eval_trajectory_writes_every_checkpoint_and_prints_one_line_each(run, tmp_path, capsys):
    import json

    from cloob_core.cli import main

    assert main(["eval", "trajectory", "--run", str(run), "--data", "mnist", "--output", str(tmp_path),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in printed[:3]] == ["step 2", "step 4", "step 6"]
    written = json.loads((tmp_path / "trajectory.json").read_text())
    assert written["data"] == "mnist-test" and [p["step"] for p in written["points"]] == [2, 4, 6]
    assert main(["eval", "trajectory", "--run", str(tmp_path / "none"), "--output", str(tmp_path)]) == 2
    assert "holds no complete checkpoints" in capsys.readouterr().err
