import json
import subprocess
import sys

import pytest
import yaml

from cloob_core.cli import main
from cloob_core.config import load_config
from cloob_core.demo import run_demo


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """Two runs with the same seed, and one with another seed: 2 epochs each (~20 s apiece on 2 cores)."""
    config = load_config(overrides=["demo.epochs=2"])
    first = run_demo(config, tmp_path_factory.mktemp("a"), progress=False)
    second = run_demo(config, tmp_path_factory.mktemp("b"), progress=False)
    return first, second


def test_demo_writes_metrics_history_and_plot(short_runs):
    result = short_runs[0]
    metrics = json.loads((result.output_dir / "metrics.json").read_text())
    assert metrics["objective"] == "cloob" and metrics["steps"] == 2 * (4000 // 128)
    assert metrics["zero_shot"]["chance"] == pytest.approx(0.1)
    assert len(metrics["zero_shot"]["per_class_accuracy"]) == 10
    history = (result.output_dir / "loss_history.csv").read_text().splitlines()
    assert history[0] == "step,loss,lr" and len(history) == metrics["steps"] + 1
    png = (result.output_dir / "training_summary.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert not list(result.output_dir.glob(".*.tmp"))  # atomic writes leave no temp files


def test_same_seed_same_metrics(short_runs):
    first, second = short_runs
    assert first.metrics["zero_shot"] == second.metrics["zero_shot"]
    assert first.metrics["final_loss"] == second.metrics["final_loss"]


def test_training_learns_well_above_chance(tmp_path):
    """A shortened demo (5 epochs, ~45 s) must already lift held-out zero-shot accuracy far above chance."""
    config = load_config(overrides=["demo.epochs=5"])
    result = run_demo(config, tmp_path, progress=False)
    zero_shot = result.metrics["zero_shot"]
    assert result.metrics["zero_shot_untrained_top1"] < 0.3
    assert zero_shot["top1"] > 0.3, zero_shot  # 3x chance; the full demo reaches ~95%


def test_cli_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "cloob_core.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "demo" in out.stdout and "config" in out.stdout


def test_cli_config_prints_params_yaml_defaults(capsys):
    assert main(["config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == load_config().model_dump()


def test_cli_rejects_bad_config_with_exit_2(capsys, tmp_path):
    assert main(["demo", "--output", str(tmp_path), "--set", "train.objective=simclr"]) == 2
    assert "train.objective" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing was written
