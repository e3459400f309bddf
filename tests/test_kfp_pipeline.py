"""The Kubeflow pipeline: the compiled YAML carries what the cluster needs, and the whole pipeline runs locally
with kfp.local (SubprocessRunner, this environment) on the embedded default."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # components/ and pipelines/ run from the repository root, uninstalled
sys.path.insert(0, str(REPO / "tests"))

# Expected here and said once: kfp.local runs the project's images' code in this environment, ignores pod settings
# (resources, display names), and kfp.Client notes the server versions it supports.
pytestmark = [
    pytest.mark.filterwarnings("ignore:You may be attemping to run a task that uses custom:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*have no effect in the current local runner:UserWarning"),
    pytest.mark.filterwarnings("ignore:This client only works with Kubeflow Pipeline:FutureWarning"),
]
STAGES = {"acquire", "validate-manifest", "download-partition", "merge-shards", "validate-shards", "train",
          "evaluate", "report", "promote"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    from pipelines.__main__ import main

    path = tmp_path_factory.mktemp("kfp") / "pipeline.yaml"
    assert main(["compile", "--output", str(path), "--partitions", "3", "--gpus", "4", "--node-selector",
                 "pool=a100"]) == 0
    documents = list(yaml.safe_load_all(path.read_text()))
    return {"spec": documents[0], "platform": documents[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]}


def tasks_of(spec: dict) -> dict[str, dict]:
    tasks = dict(spec["root"]["dag"]["tasks"])
    for component in spec["components"].values():  # the ParallelFor body is a sub-DAG
        tasks.update(component.get("dag", {}).get("tasks", {}))
    return tasks


def test_every_stage_is_present_and_the_gates_come_first(compiled):
    spec = compiled["spec"]
    tasks = tasks_of(spec)
    assert {f"comp-{stage}" for stage in STAGES} <= {task["componentRef"]["name"] for task in tasks.values()}
    assert set(tasks["train"]["dependentTasks"]) >= {"validate-shards", "merge-shards"}  # the shard gate first
    assert "report" in tasks["promote"]["dependentTasks"] and "train" in tasks["promote"]["dependentTasks"]
    loop = next(task for task in spec["root"]["dag"]["tasks"].values() if "parameterIterator" in task)
    assert "validate-manifest" in loop["dependentTasks"]  # the manifest gate before any download
    assert loop["iteratorPolicy"]["parallelismLimit"] == 3
    assert json.loads(loop["parameterIterator"]["items"]["raw"]) == ["0/3", "1/3", "2/3"]
    assert tasks["download-partition"]["retryPolicy"]["maxRetryCount"] == 3
    assert all(tasks[name]["retryPolicy"]["maxRetryCount"] == 2 for name in tasks if name.startswith("evaluate"))
    assert tasks["train"]["cachingOptions"] == {} or "enableCache" not in tasks["train"]["cachingOptions"]


def test_training_runs_on_gpu_nodes_with_shared_memory_and_the_secret(compiled):
    spec, platform = compiled["spec"], compiled["platform"]
    resources = spec["deploymentSpec"]["executors"]["exec-train"]["container"]["resources"]
    assert resources["accelerator"]["resourceCount"] == "4"
    assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert resources["resourceCpuRequest"] == "8" and resources["resourceMemoryRequest"] == "32Gi"
    train = platform["exec-train"]
    assert train["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi",
                                        "volumeName": "dshm"}]
    assert train["tolerations"][0]["key"] == "nvidia.com/gpu" and train["nodeSelector"]["labels"] == {"pool": "a100"}
    for executor in ("exec-acquire", "exec-download-partition", "exec-train"):
        mapped = {entry["envVar"] for entry in platform[executor]["secretAsEnv"][0]["keyToEnv"]}
        assert mapped == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}
    # credentials never appear as parameters
    assert not any("SECRET" in name.upper() for name in spec["root"]["inputDefinitions"]["parameters"])
    images = {executor["container"]["image"] for executor in spec["deploymentSpec"]["executors"].values()}
    assert images == {"cloob-pipelines:0.1.0-cpu", "cloob-pipelines:0.1.0-cuda"}
    assert "pip install" not in json.dumps(spec["deploymentSpec"])  # nothing installed at run time


@pytest.mark.slow  # ~2.5 minutes: CI runs it (.ci/run), the default suite does not
def test_kfp_local_runs_the_whole_pipeline_on_the_embedded_default(tmp_path):
    from kfp import local

    from pipelines.pretrain import DEFAULT_PARAMS, build, build_evaluation

    params = json.loads(DEFAULT_PARAMS)
    params["train"]["epochs"] = 3.0  # CI time
    params["promote"]["store"] = str(tmp_path / "store")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    build(partitions=2, gpus=0)(params=json.dumps(params))
    (report,) = (tmp_path / "root").glob("*/report/folder/metrics.json")
    metrics = json.loads(report.read_text())
    zeroshot = metrics["embedded-mnist-test_zeroshot_classification"]
    assert zeroshot["top1"] > 2 * zeroshot["chance"]
    assert metrics["embedded-mnist-test_linear_probe"]["top1"] > 0.5
    (merged,) = (tmp_path / "root").glob("*/merge-shards/shards/sizes.json")
    assert sum(json.loads(merged.read_text()).values()) == 4000  # both partitions' shards, merged
    (page,) = (tmp_path / "root").glob("*/report/page")
    assert page.read_text().startswith("# Evaluation report")
    pointer = json.loads((tmp_path / "store" / "production.json").read_text())  # promoted: the first model
    assert pointer["metrics"]["embedded-mnist-test_zeroshot_classification.top1"] == zeroshot["top1"]

    # The scheduled evaluation pipeline re-evaluates that production model and records its metrics.
    build_evaluation()(params=json.dumps(params))
    pointer = json.loads((tmp_path / "store" / "production.json").read_text())
    assert "evaluated_at" in pointer
    assert pointer["metrics"]["embedded-mnist-test_zeroshot_classification.top1"] == pytest.approx(zeroshot["top1"])


def test_the_evaluation_pipeline_reads_production_and_records_its_metrics(tmp_path):
    from pipelines.__main__ import main

    path = tmp_path / "evaluate.yaml"
    assert main(["compile", "--pipeline", "evaluate", "--output", str(path)]) == 0
    spec = next(yaml.safe_load_all(path.read_text()))
    tasks = tasks_of(spec)
    assert {"production-model", "report", "record-production-metrics"} <= set(tasks)
    assert "report" in tasks["record-production-metrics"]["dependentTasks"]
    assert "production-model" in tasks["evaluate"]["dependentTasks"]


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    from pipelines.__main__ import main

    path = tmp_path_factory.mktemp("package") / "pipeline.yaml"
    assert main(["compile", "--output", str(path)]) == 0
    return path


def test_submit_sends_the_compiled_pipeline_and_the_validated_configuration(package, capsys):
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main

    with KfpApiServer() as api:
        assert main(["submit", "--host", api.url, "--package", str(package), "--experiment", "cloob-ci",
                     "--run-name", "retrain-1", "--params", str(REPO / "params.yaml"), "--set",
                     "train.objective=clip", "--no-cache"]) == 0
        (run,) = api.calls("POST", "/apis/v2beta1/runs")
        (created,) = api.calls("POST", "/apis/v2beta1/experiments")
    body = run["body"]
    assert body["display_name"] == "retrain-1" and body["experiment_id"] == "exp-1"
    assert created["body"]["display_name"] == "cloob-ci"
    spec = body["pipeline_spec"]["pipeline_spec"]  # the IR, with the Kubernetes platform spec beside it
    assert spec["pipelineInfo"]["name"] == "cloob-pretrain-evaluate" and "platform_spec" in body["pipeline_spec"]
    sent = json.loads(body["runtime_config"]["parameters"]["params"])
    assert sent["train"]["objective"] == "clip" and sent["model"]["architecture"] == "cloob-tiny"
    assert all(not task.get("cachingOptions", {}).get("enableCache") for task in spec["root"]["dag"]["tasks"].values())
    assert "submitted run run-" in capsys.readouterr().out


def test_a_bad_configuration_is_refused_before_anything_is_sent(package, capsys):
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main

    with KfpApiServer() as api:
        code = main(["submit", "--host", api.url, "--package", str(package), "--run-name", "x", "--params",
                     str(REPO / "params.yaml"), "--set", "train.objective=simclr"])
        assert code == 2 and not api.calls("POST", "/apis/v2beta1/runs")
    assert "train.objective" in capsys.readouterr().err


def test_recurring_runs_are_created_listed_and_deleted(package, capsys):
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main

    with KfpApiServer() as api:
        endpoint = ["--host", api.url, "--experiment", "nightly"]
        assert main(["schedule", "create", *endpoint, "--package", str(package), "--params", str(REPO / "params.yaml"),
                     "--name", "nightly-retrain", "--cron", "0 0 3 * * *"]) == 0
        (created,) = api.calls("POST", "/apis/v2beta1/recurringruns")
        body = created["body"]
        assert body["display_name"] == "nightly-retrain" and body["mode"] == "ENABLE"
        assert int(body["max_concurrency"]) == 1 and body["no_catchup"] is True
        assert body["trigger"]["cron_schedule"]["cron"] == "0 0 3 * * *"
        assert json.loads(body["runtime_config"]["parameters"]["params"])["train"]["objective"] == "cloob"
        recurring_id = next(iter(api.recurring))
        assert main(["schedule", "list", *endpoint]) == 0
        assert f"{recurring_id}  nightly-retrain  0 0 3 * * *" in capsys.readouterr().out
        assert main(["schedule", "delete", *endpoint, recurring_id]) == 0
        assert api.calls("DELETE", f"/apis/v2beta1/recurringruns/{recurring_id}") and not api.recurring
