"""A user's evaluation suite through both pipelines: an ImageFolder tree on local disk and the same images as
CLIP_benchmark wds shards on a real S3 server (loopback), evaluated by `dvc repro` in a temporary copy of the
repository and by the Kubeflow evaluation pipeline under kfp.local, on the same model: the same metrics. Adding a
data set re-runs only its stage and the report; `dvc metrics show`, `dvc exp show` and `cloob eval compare` read the
per-data-set metrics and the suite means."""

from __future__ import annotations

import json

import pytest
import yaml
from image_server import image_folder
from test_dvc_pipeline import copy_repository, environment, run, stages_run

pytestmark = [
    pytest.mark.slow,  # ~4 minutes: CI runs it (.ci/run), the default suite does not
    pytest.mark.filterwarnings("ignore:You may be attemping to run a task that uses custom:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*have no effect in the current local runner:UserWarning"),
]
CLASSES = ("cat", "dog", "sea lion")
REPRO = ["dvc", "repro", "--single-item", "eval", "report", "promote"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory, mnist_train_shards, s3_server):
    """A copy of the repository with a short-trained model in models/train/model, and a suite of an ImageFolder
    tree and its wds copy on S3. `dvc repro --single-item eval report promote` (REPRO) runs what follows training
    (and skips what has not changed), so the data stages and training need not run here."""
    root = copy_repository(tmp_path_factory.mktemp("suite-repo"))
    env = environment()
    run(["cloob", "train", "--shards", str(mnist_train_shards), "--output", "models/train", "--steps", "40",
         "--batch-size", "64", "--no-progress", "--set", "train.tensorboard=false"], root, env)
    pets = root.parent / "pets"
    image_folder(pets, CLASSES, {"train": 6, "test": 4})
    from cloob_core import storage

    storage.s3_client().create_bucket(Bucket="cloob-benchmarks")
    run(["cloob", "data", "eval-set", "--source", str(pets), "--output", "s3://cloob-benchmarks/pets"], root, env)
    # the wds copy carries the folder names and its prompts; the folder gets the same from a class file
    templates = storage.read_bytes("s3://cloob-benchmarks/pets/zeroshot_classification_templates.txt").decode()
    (root / "classes.json").write_text(json.dumps({"classnames": list(CLASSES), "templates": templates.splitlines()}))
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["eval"]["datasets"] = {
        "pets": {"source": str(pets), "tasks": ["zeroshot", "linear-probe"], "classnames": str(root / "classes.json")},
        "pets-wds": {"source": "s3://cloob-benchmarks/pets", "tasks": ["zeroshot", "linear-probe"]},
    }
    params["eval"]["aggregates"] = {"zeroshot_acc1": {"of": "zeroshot_classification.acc1"},
                                    "linear_probe_acc1": {"of": "linear_probe.lp_acc1"}}
    params["promote"]["metric"] = "suite.zeroshot_acc1"  # the default, retrieval R@5, is not in this suite
    params["promote"]["min_first"] = {"suite.zeroshot_acc1": 0.0}  # nor in the first promotion's floor
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-qm", "a user suite"], root, env)
    return root


@pytest.fixture(scope="module")
def reproduced(repo):
    return run(REPRO, repo, environment())


def test_dvc_repro_evaluates_every_data_set_of_the_suite(repo, reproduced):
    assert sorted(stages_run(reproduced)) == ["eval@pets", "eval@pets-wds", "promote", "report"], reproduced
    metrics = json.loads((repo / "reports" / "metrics.json").read_text())
    # the same images, as an ImageFolder on disk and as wds shards on S3: the same figures
    for task, key in (("zeroshot_classification", "acc1"), ("linear_probe", "lp_acc1")):
        assert metrics[f"pets_{task}"][key] == metrics[f"pets-wds_{task}"][key]
    assert metrics["suite"]["zeroshot_acc1"] == pytest.approx(metrics["pets_zeroshot_classification"]["acc1"])
    assert "suite means over 2 data sets" in reproduced
    shown = run(["dvc", "metrics", "show", "--json"], repo, environment())
    data = json.loads(shown)
    (entry,) = [v for v in data.values() if "reports/metrics.json" in v.get("data", {})]
    assert entry["data"]["reports/metrics.json"]["data"]["suite"]["zeroshot_acc1"] == metrics["suite"]["zeroshot_acc1"]


def test_adding_a_data_set_reruns_only_its_stage_and_what_reads_the_report(repo, reproduced):
    env = environment()
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["eval"]["datasets"]["digits"] = {"source": "sklearn-digits"}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    status = run(["dvc", "status", "eval", "report"], repo, env)
    assert "eval@digits" in status and "eval@pets:" not in status and "eval@pets-wds" not in status, status
    output = run(REPRO, repo, env)
    assert sorted(stages_run(output)) == ["eval@digits", "promote", "report"], output
    metrics = json.loads((repo / "reports" / "metrics.json").read_text())
    assert "digits_zeroshot_classification" in metrics and "suite means over 3 data sets" in output
    run(["git", "add", "-A"], repo, env)
    run(["git", "commit", "-qm", "a third data set"], repo, env)
    table = run(["dvc", "exp", "show", "--no-pager", "--md"], repo, env)
    assert "suite.zeroshot_acc1" in table and "digits_zeroshot_classification.acc1" in table, table
    compared = run(["cloob", "eval", "compare", "--run", "a=reports/metrics.json", "--run",
                    "b=reports/metrics.json"], repo, env)
    header = next(line for line in compared.splitlines() if line.startswith("| run | suite."))
    assert {"suite.zeroshot_acc1", "suite.linear_probe_acc1"} <= set(header.strip("| ").split(" | "))
    assert "| b | digits |" in compared


def test_the_kubeflow_evaluation_pipeline_gives_the_same_metrics_for_the_same_model(repo, reproduced, tmp_path):
    from kfp import local

    from pipelines.local_run import kfp_local_state_kept
    from pipelines.pretrain import build_evaluation

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["promote"]["store"] = str(tmp_path / "store")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # production: the model DVC evaluated
    run(["cloob", "promote", "--params", str(tmp_path / "params.yaml"), "--model", "models/train/model",
         "--metrics", "reports/metrics.json", "--output", str(tmp_path / "decision.json")], repo, environment())
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    with kfp_local_state_kept():  # (kfp.local's steps, in threads, would leave a print indented, a handler stale)
        build_evaluation()(params=json.dumps(params))
    (report,) = (tmp_path / "root").glob("*/report/folder/metrics.json")
    ours, dvc = json.loads(report.read_text()), json.loads((repo / "reports" / "metrics.json").read_text())
    assert set(ours) == set(dvc) and "suite" in ours
    for name, scalars in dvc.items():
        assert ours[name] == pytest.approx(scalars, rel=1e-6), name
    pointer = json.loads((tmp_path / "store" / "production.json").read_text())  # its re-evaluation recorded
    assert "evaluated_at" in pointer
    assert pointer["metrics"]["suite.zeroshot_acc1"] == pytest.approx(dvc["suite"]["zeroshot_acc1"], rel=1e-6)
    # both pipelines fingerprint the suite alike, so the gate compares their metrics
    fingerprint = json.loads((report.parent / "suite.json").read_text())
    assert fingerprint == json.loads((repo / "reports" / "suite.json").read_text())
    assert pointer["suite"] == fingerprint["digest"]
    assert fingerprint["datasets"]["pets-wds"]["content"]["kind"] == "etag"
