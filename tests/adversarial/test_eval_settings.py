"""Evaluation settings that used to be accepted silently and give a wrong figure: each is now refused before
any result is written, with exit status 2 and the setting named, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from image_server import photo_bytes

from cloob_core.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """An image folder with two classes and no train/ or test/ split inside."""
    root = tmp_path_factory.mktemp("photos") / "photos"
    for label in ("cats", "dogs"):
        (root / label).mkdir(parents=True)
        for i in range(3):
            (root / label / f"{i}.jpg").write_bytes(photo_bytes(10 * len(label) + i))
    return root


def refused(capsys, argv: list[str], output: Path, *expected: str) -> None:
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and all(text in error for text in expected), error
    assert not output.exists() or not any(output.glob("*.json"))  # no result written


def class_file(tmp_path: Path, data: object) -> str:
    path = tmp_path / "classes.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


@pytest.mark.parametrize(("data", "expected"), [
    ({"classnames": "cats", "templates": ["a photo of a {c}."]}, "'classnames' must be a non-empty list"),
    ({"classnames": ["cats", "dogs"], "templates": ["a photo."]}, "has no {c}"),
    ({"classnames": ["cats", "dogs"], "templates": []}, "'templates' must be a non-empty list"),
    ("{not json", "is not valid JSON"),
    (["cats", "dogs"], "must hold an object"),
])
def test_a_class_name_file_that_would_score_nonsense_is_refused(capsys, tmp_path, weights, folder, data, expected):
    output = tmp_path / "out"
    refused(capsys, ["eval", "zeroshot", "--architecture", "cloob-tiny", "--weights", str(weights), "--data",
                     str(folder), "--classnames", class_file(tmp_path, data), "--output", str(output), "--no-cache",
                     "--no-progress"], output, "--classnames", expected)


def test_a_probe_scored_on_its_own_training_images_is_refused(capsys, tmp_path, weights, folder):
    output = tmp_path / "out"
    refused(capsys, ["eval", "linear-probe", "--architecture", "cloob-tiny", "--weights", str(weights),
                     "--train-data", str(folder), "--output", str(output), "--no-cache", "--no-progress"], output,
            "test images would be its training images", "--test-data")


@pytest.mark.parametrize(("argv", "expected"), [
    (["linear-probe", "--few-shot", "-1"], "--few-shot must be at least 1"),
    (["linear-probe", "--few-shot", "0"], "--few-shot must be at least 1"),
    (["zeroshot", "--hopfield-beta", "nan"], "--hopfield-beta must be a finite number"),
    (["zeroshot", "--hopfield-beta", "-2"], "--hopfield-beta must be a finite number"),
])
def test_out_of_range_task_settings_are_refused_before_the_model_loads(capsys, tmp_path, argv, expected):
    output = tmp_path / "out"
    refused(capsys, ["eval", *argv, "--model", str(tmp_path / "no-model"), "--output", str(output)], output, expected)


def test_compile_refuses_a_negative_gpu_count(capsys, tmp_path):
    from pipelines.__main__ import main as pipelines_main

    assert pipelines_main(["compile", "--gpus", "-1", "--output", str(tmp_path / "p.yaml")]) == 2
    error = capsys.readouterr().err
    assert "gpus" in error and "greater than or equal to 0" in error and "Traceback" not in error
    assert not (tmp_path / "p.yaml").exists()
