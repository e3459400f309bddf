"""Evaluation sets that cannot rank anything are refused, not averaged: one class, class folders without images,
a source bucket that does not exist, each one line naming eval.datasets.NAME before any model loads; a probe with
one training image per class is a bounded run with a warning in the report; a suite mean never takes a figure that
is 100% by construction; and results of an evaluation that stopped part-way are refused by the report."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import yaml
from hostile import cli, snapshot
from image_server import image_folder

from cloob_core.config import EvalConfig
from cloob_core.evaluation.suite_error import SuiteError
from cloob_core.evaluation.suite_report import aggregate, ranks_nothing

NO_MODEL = ["--architecture", "cloob-tiny", "--weights", "/nonexistent/weights.pt", "--no-progress"]


def suite_params(tmp_path: Path, datasets: dict, aggregates: dict | None = None) -> Path:
    path = tmp_path / "params.yaml"
    first = next(iter(datasets))
    result = "linear_probe.lp_acc1" if "linear-probe" in datasets[first]["tasks"] else "zeroshot_classification.acc1"
    path.write_text(yaml.safe_dump({"eval": {"datasets": datasets, "aggregates": aggregates or {}},
                                    "promote": {"metric": f"{first}_{result}", "guards": {}, "min_first": {}}}))
    return path


def refused_before_the_model(capsys, tmp_path: Path, datasets: dict, *expected: str) -> str:
    out = tmp_path / "out"
    done = cli(capsys, "eval", "suite", "--params", suite_params(tmp_path, datasets), "--output", out, *NO_MODEL)
    line = done.error_line()
    assert done.code == 2 and all(text in line for text in expected), line
    assert "weights" not in line and not out.exists()  # the entry was refused before the model was looked at
    return line


@pytest.mark.parametrize("task", ["zeroshot", "linear-probe"])
def test_a_set_with_one_class_is_refused_naming_the_entry(capsys, tmp_path, task):
    root = image_folder(tmp_path / "one", ["cats"], {"train": 3, "test": 3})
    refused_before_the_model(capsys, tmp_path, {"single": {"source": str(root), "tasks": [task]}},
                             "cloob: eval.datasets.single: ", "has 1 class (cats)", "at least two")


def test_a_class_folder_without_images_is_refused_naming_the_entry(capsys, tmp_path):
    root = image_folder(tmp_path / "pets", ["cats", "dogs"], {"train": 2, "test": 2})
    (root / "test" / "birds").mkdir()
    (root / "test" / "birds" / "notes.txt").write_text("no images here")
    refused_before_the_model(capsys, tmp_path, {"pets": {"source": str(root), "tasks": ["zeroshot"]}},
                             "cloob: eval.datasets.pets: ", "class folders without images (birds)")


def test_a_source_bucket_that_does_not_exist_is_named_with_the_entry(capsys, tmp_path, s3_server):
    refused_before_the_model(capsys, tmp_path, {"remote": {"source": "s3://no-such-bucket-here/eval",
                                                           "tasks": ["zeroshot"]}},
                             "cloob: eval.datasets.remote: source s3://no-such-bucket-here/eval cannot be read",
                             "NoSuchBucket")


def test_a_probe_with_one_training_image_per_class_is_bounded_and_warns(capsys, tmp_path, weights):
    root = image_folder(tmp_path / "few", [f"c{i}" for i in range(6)], {"train": 1, "test": 2})
    out = tmp_path / "out"
    done = cli(capsys, "eval", "suite", "--params", suite_params(tmp_path, {"few": {
        "source": str(root), "tasks": ["linear-probe"]}}), "--output", out, "--architecture", "cloob-tiny",
        "--weights", weights, "--no-progress")
    assert done.code == 0, done.err
    assert "not searched" in done.out
    record = json.loads((out / "few" / "few_linear_probe.json").read_text())
    assert record["metrics"]["lambda_"] == 1.0 and "one training image per class" in record["warnings"][0]
    assert "**warning:** one training image per class" in (out / "few" / "report.md").read_text()


def test_a_figure_that_is_100_percent_by_construction_never_enters_a_suite_mean():
    assert ranks_nothing("acc5", {"chance": 1 / 3}) and not ranks_nothing("acc1", {"chance": 1 / 3})
    assert ranks_nothing("lp_acc5", {"chance": 0.2}) and not ranks_nothing("acc5", {"chance": 0.1})
    assert ranks_nothing("image_retrieval_recall@5", {"images": 4, "captions": 40})
    assert not ranks_nothing("text_retrieval_recall@5", {"images": 4, "captions": 40})
    settings = EvalConfig.model_validate({
        "datasets": {"three": {"source": "mnist", "tasks": ["zeroshot"]},
                     "ten": {"source": "mnist", "tasks": ["zeroshot"]}},
        "aggregates": {"top5": {"of": ["zeroshot_classification.acc5"]},
                       "top1": {"of": ["zeroshot_classification.acc1"]}}})
    metrics = {"three_zeroshot_classification": {"acc1": 0.5, "acc5": 1.0, "chance": 1 / 3},
               "ten_zeroshot_classification": {"acc1": 0.3, "acc5": 0.7, "chance": 0.1}}
    assert aggregate(settings, metrics) == pytest.approx({"top5": 0.7, "top1": 0.4})
    only_small = EvalConfig.model_validate({
        "datasets": {"three": {"source": "mnist", "tasks": ["zeroshot"]}},
        "aggregates": {"top5": {"of": ["zeroshot_classification.acc5"]}}})
    with pytest.raises(SuiteError, match=r"eval\.aggregates\.top5: every figure it averages ranks nothing"):
        aggregate(only_small, metrics)


def test_an_evaluation_that_stops_part_way_changes_nothing_and_a_report_refuses_unmarked_results(
        capsys, tmp_path, weights, monkeypatch):
    params = suite_params(tmp_path, {"mnist": {"source": "mnist", "tasks": ["zeroshot", "retrieval"]}})
    out, report = tmp_path / "eval", tmp_path / "report"
    run = ["eval", "suite", "--params", params, "--output", out, "--architecture", "cloob-tiny", "--weights",
           weights, "--no-progress"]
    assert cli(capsys, *run).code == 0
    assert cli(capsys, "eval", "report", "--params", params, "--inputs", out, "--output", report).code == 0
    before = snapshot(out)
    from cloob_core.evaluation.tasks import retrieval

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(retrieval, "retrieval", full_disk)  # the second task fails after zeroshot's result
    failed = cli(capsys, *run)
    assert failed.code == 2 and failed.error_line().startswith("cloob: eval.datasets.mnist: no space left")
    assert snapshot(out) == before  # zeroshot's new result was never published: the data set's folder is as it was
    # results written without the suite's completion mark (an evaluation folder of an older version, edited by
    # hand) are refused by the suite's report, which then writes nothing
    index = out / "mnist" / ".report.json"
    entries = json.loads(index.read_text())
    del entries["mnist_zeroshot_classification"]["complete"]
    index.write_text(json.dumps(entries))
    (out / "mnist" / ".cloob-unit.json").unlink()
    done = cli(capsys, "eval", "report", "--params", params, "--inputs", out, "--output", tmp_path / "again")
    line = done.error_line()
    assert done.code == 2 and "eval.datasets.mnist: mnist_zeroshot_classification" in line and "incomplete" in line
    assert not (tmp_path / "again" / "suite.json").exists()
