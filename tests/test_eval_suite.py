"""The evaluation suite of the configuration (`eval` in params.yaml): `cloob eval suite` evaluates each data set on
its tasks, `cloob eval report --params` combines them with the suite's aggregates, and an entry that cannot run
fails before the model loads, naming the entry."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from image_server import image_folder, photo_bytes

from cloob_core.cli import main
from cloob_core.config import ConfigError, EvalConfig, config_from_text

CLASSES = ("cat", "dog", "sea_lion")


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """An ImageFolder tree with train/ and test/, as ImageNet's is laid out."""
    root = tmp_path_factory.mktemp("suite") / "photos"
    image_folder(root, CLASSES, {"train": 5, "test": 3})
    return root


def suite_params(path: Path, datasets: dict, aggregates: dict | None = None, promote: dict | None = None) -> Path:
    params = {"eval": {"datasets": datasets, **({"aggregates": aggregates} if aggregates is not None else {})},
              "promote": promote or {"metric": "suite.zeroshot_acc1", "guards": {}, "min_first": {}}}
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def two_sets(photos: Path) -> dict:
    return {"photos": {"source": str(photos), "tasks": ["zeroshot", "linear-probe", "retrieval"],
                       "classnames": str(photos.parent / "classes.json")},
            "digits": {"source": "sklearn-digits", "tasks": ["zeroshot", "linear-probe"], "batch_size": 512}}


@pytest.fixture(scope="module")
def evaluated(photos, weights, tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("evaluated")
    (photos.parent / "classes.json").write_text(json.dumps({"classnames": ["cat", "dog", "sea lion"],
                                                            "templates": ["a photo of a {c}."]}))
    params = suite_params(root / "params.yaml", two_sets(photos))
    model = ["--architecture", "cloob-tiny", "--weights", str(weights)]
    assert main(["eval", "suite", "--params", str(params), *model, "--output", str(root / "eval"),
                 "--no-progress"]) == 0
    assert main(["eval", "report", "--params", str(params), "--inputs", str(root / "eval"), "--output",
                 str(root / "report")]) == 0
    return root, params, json.loads((root / "report" / "metrics.json").read_text())


def test_each_data_set_of_the_suite_is_evaluated_on_its_tasks_under_clip_benchmark_names(evaluated):
    root, _, metrics = evaluated
    assert sorted(p.name for p in (root / "eval").iterdir()) == ["digits", "photos"]
    assert set(metrics) == {"photos_zeroshot_classification", "photos_linear_probe", "photos_zeroshot_retrieval",
                            "digits_zeroshot_classification", "digits_linear_probe", "suite"}
    assert {"acc1", "acc3", "mean_per_class_recall"} <= set(metrics["photos_zeroshot_classification"])
    assert {"lp_acc1", "lp_acc5", "lp_mean_per_class_recall"} <= set(metrics["digits_linear_probe"])
    assert {"image_retrieval_recall@5", "text_retrieval_recall@5"} <= set(metrics["photos_zeroshot_retrieval"])
    record = json.loads((root / "report" / "results" / "digits_zeroshot_classification.json").read_text())
    assert record["dataset"] == "digits" and record["task"] == "zeroshot_classification"  # CLIP_benchmark's layout
    assert len(record["metrics"]["confusion_matrix"]) == 10 and sum(map(sum, record["metrics"]["confusion_matrix"])) \
        == 899  # scikit-learn's digits: the second half tests
    assert metrics["digits_linear_probe"]["train_size"] == 898


def test_the_suite_means_are_the_means_over_the_data_sets_that_ran_the_task(evaluated):
    _, _, metrics = evaluated
    suite = metrics["suite"]
    assert set(suite) == {"zeroshot_acc1", "linear_probe_acc1", "retrieval_recall@1", "retrieval_recall@5"}
    assert suite["zeroshot_acc1"] == pytest.approx(statistics.fmean(
        [metrics["photos_zeroshot_classification"]["acc1"], metrics["digits_zeroshot_classification"]["acc1"]]))
    assert suite["linear_probe_acc1"] == pytest.approx(statistics.fmean(
        [metrics["photos_linear_probe"]["lp_acc1"], metrics["digits_linear_probe"]["lp_acc1"]]))
    retrieval = metrics["photos_zeroshot_retrieval"]  # only photos runs retrieval
    assert (retrieval["images"], retrieval["captions"]) == (9, 3)
    assert suite["retrieval_recall@1"] == pytest.approx(
        (retrieval["image_retrieval_recall@1"] + retrieval["text_retrieval_recall@1"]) / 2)
    # image -> text recall@5 over 3 captions is 100% by construction, so only text -> image (9 images) enters R@5
    assert retrieval["text_retrieval_recall@5"] == 1.0
    assert suite["retrieval_recall@5"] == pytest.approx(retrieval["image_retrieval_recall@5"])


def test_the_report_prints_a_row_per_data_set_and_the_suite_means(evaluated, capsys):
    root, _, _ = evaluated
    assert main(["eval", "summary", "--metrics", str(root / "report" / "metrics.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["data", "set", "zero-shot"]
    assert [line.split()[0] for line in lines[2:4]] == ["digits", "photos"]
    assert "suite means over 2 data sets" in lines
    assert any(line.split()[0] == "suite.zeroshot_acc1" for line in lines)
    page = (root / "report" / "report.md").read_text()
    assert "| suite mean |" in page and "## digits_zeroshot_classification" in page


def test_a_data_set_left_out_of_the_suite_is_left_out_of_the_report_and_a_missing_one_is_named(evaluated, photos,
                                                                                                 capsys):
    root, _, _ = evaluated
    only_photos = suite_params(root / "photos.yaml", {"photos": two_sets(photos)["photos"]})
    assert main(["eval", "report", "--params", str(only_photos), "--inputs", str(root / "eval"), "--output",
                 str(root / "photos-report")]) == 0
    metrics = json.loads((root / "photos-report" / "metrics.json").read_text())
    assert not any(name.startswith("digits") for name in metrics)
    assert metrics["suite"]["zeroshot_acc1"] == metrics["photos_zeroshot_classification"]["acc1"]
    three = suite_params(root / "three.yaml", {**two_sets(photos), "mnist": {"source": "mnist"}})
    assert main(["eval", "report", "--params", str(three), "--inputs", str(root / "eval"), "--output",
                 str(root / "three-report")]) == 2
    assert "no results for mnist_zeroshot_classification" in capsys.readouterr().err


def test_a_data_set_s_tasks_share_features_computed_ahead(evaluated, weights, monkeypatch, tmp_path):
    """The Kubeflow fan-out: one step encodes a data set's images, each task step reads them and encodes none."""
    from cloob_core.evaluation.suite import evaluate_suite, prepare_features
    from cloob_core.model.source import EvalModel, ModelSource

    _, params, metrics = evaluated
    settings = config_from_text(params.read_text()).eval
    model = ModelSource(architecture="cloob-tiny", weights=str(weights))
    assert prepare_features(settings, "photos", model, tmp_path / "features", progress=False) == \
        ["zeroshot", "linear-probe", "retrieval"]

    def refuse(*_):
        raise AssertionError("a task step encoded images")

    monkeypatch.setattr(EvalModel, "encode_images", refuse)
    for task in ("zeroshot", "linear-probe"):
        (result,) = evaluate_suite(settings, model, tmp_path / task, datasets=["photos"], tasks=[task],
                                   shared_features=tmp_path / "features", progress=False)
        for name, scalars in result.metrics.items():
            assert {k: v for k, v in scalars.items() if isinstance(v, float)} == pytest.approx(
                {k: v for k, v in metrics[name].items() if isinstance(v, float)})


@pytest.mark.parametrize(("entry", "message"), [
    ({"source": "/nonexistent/imagenet"}, "eval.datasets.broken: source /nonexistent/imagenet does not exist"),
    ({"source": "mnist", "classnames": "imagenett"}, "eval.datasets.broken: classnames 'imagenett' is no file "
                                                        "and no packaged class list"),
    ({"source": "PHOTOS", "tasks": ["linear-probe"], "splits": {"train": "training"}},
     "eval.datasets.broken: PHOTOS has no split 'training'"),
    ({"source": "PHOTOS/test", "tasks": ["linear-probe"]}, "the linear probe needs separate train and test images"),
    ({"source": "mnist", "tasks": ["zeroshot", "linearprobe"]}, "eval.datasets.broken.tasks.1: Input should be"),
    ({"source": "sklearn-digits", "splits": {"test": "val"}}, "sklearn-digits has the splits train and test, not val"),
])
def test_a_broken_entry_fails_before_the_model_loads_and_names_the_entry(photos, tmp_path, capsys, entry, message):
    entry = json.loads(json.dumps(entry).replace("PHOTOS", str(photos)))
    message = message.replace("PHOTOS", str(photos))
    params = suite_params(tmp_path / "p.yaml", {"fine": {"source": "mnist"}, "broken": entry})
    # the model does not exist: loading it first would fail with another message
    assert main(["eval", "suite", "--params", str(params), "--model", str(tmp_path / "no-model"), "--output",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and len(err) == 1, err
    assert not (tmp_path / "out" / "fine").exists()  # nothing evaluated


@pytest.mark.parametrize(("text", "message"), [
    ("eval:\n  datasets:\n    a: {source: mnist}\n    a: {source: sklearn-digits}\n", "key 'a' is given twice"),
    ("eval:\n  datasets:\n    a.b: {source: mnist}\n", "data set name 'a.b' must be"),
    ("eval:\n  datasets:\n    suite: {source: mnist}\n", "data set name 'suite' must be"),
    ("eval:\n  datasets:\n    a: {tasks: [zeroshot]}\n", "eval.datasets.a.source: Field required"),
    ("eval:\n  datasets:\n    a: {source: mnist}\n  aggregates:\n    z: {of: zero_shot.acc1}\n",
     "aggregates.z: 'zero_shot.acc1' is not RESULT.KEY"),
    ("eval:\n  datasets:\n    a: {source: mnist}\n  aggregates:\n    z: {of: linear_probe.lp_acc1}\n",
     "aggregates.z: no data set of the suite runs 'linear-probe'"),
    ("eval:\n  datasets:\n    a: {source: mnist}\n  aggregates:\n    z: {of: zeroshot_classification.acc1, "
     "datasets: [b]}\n", "aggregates.z: no data set named ['b']"),
    ("promote: {metric: mnist_zeroshot_classification.top1, guards: {}}\n"
     "eval:\n  datasets:\n    digits: {source: sklearn-digits}\n",
     "promote.metric: 'mnist_zeroshot_classification.top1': the eval suite writes no result "
     "'mnist_zeroshot_classification'"),
    ("promote: {metric: suite.zeroshot_top1}\n", "promote.metric: 'suite.zeroshot_top1' names no aggregate"),
])
def test_a_suite_that_cannot_be_meant_is_refused_with_the_entry_named(text, message):
    with pytest.raises(ConfigError) as raised:
        config_from_text(text)
    assert message in str(raised.value)


def test_the_default_aggregates_apply_where_a_user_suite_has_their_tasks():
    settings = config_from_text("eval:\n  datasets:\n    imagenet: {source: /data/imagenet}\n"
                                "promote: {metric: suite.zeroshot_acc1, guards: {}, min_first: {}}\n").eval
    assert list(settings.aggregates) == ["zeroshot_acc1"]  # no probe, no retrieval: their means would be empty
    assert settings.contributors("zeroshot_acc1", "zeroshot_classification") == ["imagenet"]
    assert EvalConfig().metric_names() >= {"mnist_zeroshot_classification", "emoji_linear_probe",
                                           "captioned_zeroshot_retrieval", "captioned_diagnostics", "suite"}


def test_an_aggregate_over_a_metric_a_data_set_lacks_is_named():
    from cloob_core.evaluation.suite_error import SuiteError
    from cloob_core.evaluation.suite_report import aggregate

    settings = config_from_text("eval:\n  datasets:\n    a: {source: mnist}\n    b: {source: mnist}\n"
                                "  aggregates:\n    top5: {of: zeroshot_classification.acc5}\n"
                                "promote: {metric: suite.top5, guards: {}, min_first: {}}\n").eval
    with pytest.raises(SuiteError, match=r"eval.aggregates.top5: b_zeroshot_classification has no metric 'acc5'"):
        aggregate(settings, {"a_zeroshot_classification": {"acc5": 0.9}, "b_zeroshot_classification": {"acc3": 1.0}})
    assert aggregate(settings, {"a_zeroshot_classification": {"acc5": 0.9},
                                "b_zeroshot_classification": {"acc5": 0.5}}) == {"top5": pytest.approx(0.7)}


def test_the_report_records_the_suite_fingerprint_that_promotion_compares(evaluated, photos, tmp_path):
    import shutil

    from cloob_core.evaluation.fingerprint import dataset_fingerprint
    from cloob_core.evaluation.suite_report import suite_fingerprint

    root, params, _ = evaluated
    recorded = json.loads((root / "report" / "suite.json").read_text())
    settings = config_from_text(params.read_text()).eval
    assert set(recorded["datasets"]) == {"photos", "digits"}
    assert recorded["datasets"]["digits"]["content"]["kind"] == "packaged"
    assert recorded["datasets"]["photos"]["content"]["kind"] == "stat"
    assert recorded["datasets"]["photos"]["classnames"]["digest"]  # the class file's content counts too
    assert suite_fingerprint(settings, recorded["datasets"])["digest"] == recorded["digest"]
    # the same data gives the same fingerprint; a changed image, another few-shot K or aggregate another one
    copy = tmp_path / "photos"
    shutil.copytree(photos, copy)
    entry = settings.datasets["photos"].model_copy(update={"source": str(copy)})
    before = dataset_fingerprint(entry)
    assert dataset_fingerprint(entry) == before
    (copy / "test" / "cat" / "0.jpg").write_bytes(photo_bytes(999))
    assert dataset_fingerprint(entry)["content"] != before["content"]
    assert dataset_fingerprint(entry.model_copy(update={"few_shot": 4})) != dataset_fingerprint(entry)
    fewer = settings.model_copy(update={"aggregates": {"zeroshot_acc1": settings.aggregates["zeroshot_acc1"]}})
    assert suite_fingerprint(fewer, recorded["datasets"])["digest"] != recorded["digest"]


def test_a_task_that_no_chosen_data_set_runs_is_named(tmp_path, capsys):
    assert main(["eval", "suite", "--dataset", "mnist", "--task", "retrieval", "--model", str(tmp_path / "none"),
                 "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == "cloob: no data set of mnist runs retrieval in eval.datasets"
    assert not (tmp_path / "out").exists()
