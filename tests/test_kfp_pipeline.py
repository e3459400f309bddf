"""The Kubeflow pipeline: the compiled YAML carries what the cluster needs, and the whole pipeline runs locally
with kfp.local (SubprocessRunner, this environment) on the packaged default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # components/ and pipelines/ run from the repository root, uninstalled
sys.path.insert(0, str(REPO / "tests"))

from components.image_names import image_tag  # noqa: E402  (after the path: components/ is not installed)

# Expected here and said once: kfp.local runs the project's images' code in this environment, ignores pod settings
# (resources, display names), and kfp.Client notes the server versions it supports.
pytestmark = [
    pytest.mark.filterwarnings("ignore:You may be attemping to run a task that uses custom:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*have no effect in the current local runner:UserWarning"),
    pytest.mark.filterwarnings("ignore:This client only works with Kubeflow Pipeline:FutureWarning"),
]
STAGES = {"acquire", "validate-manifest", "plan-download", "download-partition", "merge-shards", "validate-shards",
          "train",
          "plan-evaluation", "prepare-features", "evaluate", "collect-dataset", "report", "promote"}


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
    loop = next(task for task in spec["root"]["dag"]["tasks"].values()
                if "plan-download" in task.get("parameterIterator", {}).get("items", {}).get("inputParameter", ""))
    assert {"validate-manifest", "plan-download"} <= set(loop["dependentTasks"])  # the gate before any download
    assert "validate-manifest" in tasks["plan-download"]["dependentTasks"]
    assert loop["iteratorPolicy"]["parallelismLimit"] == 3
    # the items are the planning step's, at run time: at most --partitions (3 here) ranges of shards
    assert tasks["plan-download"]["inputs"]["parameters"]["most"]["runtimeValue"]["constant"] == 3
    assert tasks["download-partition"]["retryPolicy"]["maxRetryCount"] == 3
    # the partitions write into one folder, the acquire step's answer; the merge waits for all of them
    shards = {"taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "acquire"}}
    assert tasks["merge-shards"]["inputs"]["parameters"]["shards"] == shards
    assert tasks["merge-shards"]["inputs"]["parameters"]["parts"]["taskOutputParameter"]["producerTask"] == \
        loop["taskInfo"]["name"]
    merged = {"taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "merge-shards"}}
    assert tasks["validate-shards"]["inputs"]["parameters"]["shards"] == merged
    assert tasks["train"]["inputs"]["parameters"]["shards"] == merged
    assert all(tasks[name]["retryPolicy"]["maxRetryCount"] == 2 for name in ("prepare-features", "evaluate"))
    assert tasks["train"]["cachingOptions"] == {} or "enableCache" not in tasks["train"]["cachingOptions"]


def test_the_download_loop_holds_at_most_256_iterations_however_wide_the_fan_out_asked(tmp_path):
    spec = compile_with(tmp_path, "--partitions", "1000", "--download-parallelism", "64")["spec"]
    tasks = tasks_of(spec)
    assert tasks["plan-download"]["inputs"]["parameters"]["most"]["runtimeValue"]["constant"] == 256
    loop = next(task for task in spec["root"]["dag"]["tasks"].values() if "parameterIterator" in task
                and "plan-download" in task["parameterIterator"]["items"].get("inputParameter", ""))
    assert loop["iteratorPolicy"]["parallelismLimit"] == 64


def test_training_runs_on_gpu_nodes_with_shared_memory_and_the_secret(compiled):
    spec, platform = compiled["spec"], compiled["platform"]
    resources = spec["deploymentSpec"]["executors"]["exec-train"]["container"]["resources"]
    assert resources["accelerator"]["resourceCount"] == "4"
    assert resources["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert resources["resourceCpuRequest"] == "44" and resources["resourceMemoryRequest"] == "32Gi"  # 11 per GPU
    train = platform["exec-train"]
    assert train["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm", "sizeLimit": "16Gi",
                                        "volumeName": "dshm"}]
    assert train["tolerations"][0]["key"] == "nvidia.com/gpu" and train["nodeSelector"]["labels"] == {"pool": "a100"}
    for executor in ("exec-acquire", "exec-plan-download", "exec-download-partition", "exec-merge-shards",
                     "exec-validate-shards",
                     "exec-train", "exec-plan-evaluation", "exec-prepare-features", "exec-evaluate", "exec-promote"):
        mapped = {entry["envVar"]: bool(secret.get("optional")) for secret in platform[executor]["secretAsEnv"]
                  for entry in secret["keyToEnv"]}  # the endpoint optional: AWS S3 has none
        assert mapped == {"AWS_ACCESS_KEY_ID": False, "AWS_SECRET_ACCESS_KEY": False, "AWS_ENDPOINT_URL": True}
    # credentials never appear as parameters
    assert not any("SECRET" in name.upper() for name in spec["root"]["inputDefinitions"]["parameters"])
    images = {executor["container"]["image"] for executor in spec["deploymentSpec"]["executors"].values()}
    assert images == {f"cloob-pipelines:{image_tag()}-cpu", f"cloob-pipelines:{image_tag()}-cuda"}
    assert "pip install" not in json.dumps(spec["deploymentSpec"])  # nothing installed at run time


def test_the_features_step_gets_a_gpu_on_the_training_nodes_and_the_task_steps_cpu_pods(compiled, tmp_path):
    spec, platform = compiled["spec"], compiled["platform"]
    executors = spec["deploymentSpec"]["executors"]
    features = executors["exec-prepare-features"]["container"]
    accelerator = features["resources"]["accelerator"]
    assert accelerator["resourceCount"] == "1" and accelerator["resourceType"] == "nvidia.com/gpu"
    assert features["resources"]["resourceCpuRequest"] == "11"  # cpu_per_gpu: its data-loader workers decode
    assert {"name": "LOKY_MAX_CPU_COUNT", "value": "11"} in features["env"]
    assert features["image"] == f"cloob-pipelines:{image_tag()}-cuda"
    on_gpus = platform["exec-prepare-features"]
    assert on_gpus["tolerations"] == platform["exec-train"]["tolerations"]
    assert on_gpus["nodeSelector"] == {"labels": {"pool": "a100"}}
    assert on_gpus["emptyDirMounts"] == platform["exec-train"]["emptyDirMounts"]
    task = executors["exec-evaluate"]["container"]["resources"]  # probe, zero-shot on the computed features
    assert "accelerator" not in task and task["resourceCpuRequest"] == "4" and task["resourceMemoryRequest"] == "16Gi"
    assert "tolerations" not in platform["exec-evaluate"] and "nodeSelector" not in platform["exec-evaluate"]

    for pipeline in ("pretrain", "evaluate"):
        (tmp_path / pipeline).mkdir()
        (tmp_path / f"{pipeline}-gpu").mkdir()
        cpu = compile_with(tmp_path / pipeline, "--pipeline", pipeline, "--gpus", "4", "--node-selector", "pool=a100",
                           "--eval-gpus", "0", "--eval-cpu", "6")
        resources = cpu["spec"]["deploymentSpec"]["executors"]["exec-prepare-features"]["container"]["resources"]
        assert "accelerator" not in resources and resources["resourceCpuRequest"] == "6"
        assert "tolerations" not in cpu["platform"]["exec-prepare-features"]
        assert "nodeSelector" not in cpu["platform"]["exec-prepare-features"]
        gpu = compile_with(tmp_path / f"{pipeline}-gpu", "--pipeline", pipeline, "--gpus", "8", "--eval-gpus", "2")
        resources = gpu["spec"]["deploymentSpec"]["executors"]["exec-prepare-features"]["container"]["resources"]
        assert resources["accelerator"]["resourceCount"] == "2" and resources["resourceCpuRequest"] == "22"
    (tmp_path / "cpu").mkdir()
    cpu_cluster = compile_with(tmp_path / "cpu", "--gpus", "0")  # no training GPUs: no evaluation GPU either
    assert "accelerator" not in cpu_cluster["spec"]["deploymentSpec"]["executors"]["exec-prepare-features"][
        "container"]["resources"]


def test_no_step_copies_the_shards_into_its_pod(tmp_path):
    """KFP's launcher copies every input artifact into the pod before the step starts: the shards must reach
    the gate and training as a location. What is still copied is small: the manifest, the model, features and
    reports (the list below is `python -m pipelines inputs`)."""
    from pipelines.copied_inputs import step_inputs

    small = {"manifest (system.Dataset)", "model (system.Model)", "features (system.Dataset)",
             "parts (system.Dataset)", "datasets (system.Dataset)", "report (system.Dataset)",
             "pool (system.Dataset)"}  # (the scoring steps': the pool's location, in its metadata)
    for options in ((), ("--data", "import"), ("--nodes", "2"), ("--curation",)):
        steps = {s.step: s for s in step_inputs(compile_with(tmp_path, *options)["spec"])}
        for name in ("validate-shards", "train" if "--nodes" not in options else "train-multinode"):
            assert steps[name].copied == () and "shards" in steps[name].by_value, (options, steps[name])
        assert set().union(*(s.copied for s in steps.values())) <= small, options
        if not options:
            assert steps["download-partition"].copied == ("manifest (system.Dataset)",)
            assert steps["merge-shards"].copied == ()
        if "--curation" in options:
            assert steps["curate"].copied == () and "shards" in steps["curate"].by_value


class TrainingKiller:
    """Kills the one-node training step (SIGKILL to its process tree: the executor and its data-loader workers) once
    its first checkpoint is mirrored, whole, to the job workdir, as a node that dies under a pod does; a thread
    beside the kfp.local run in this process. ``killed`` holds the command lines it killed."""

    def __init__(self, workdir: str):
        import threading

        self.workdir, self.killed, self.seen = workdir, [], {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _step(self) -> list:
        """The training step's processes: the one whose function (after --function_to_execute) is train, and every
        process under it. Another step may have "train" among its arguments (a split)."""
        import contextlib

        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error, IndexError):
                command = child.cmdline()
                if "--function_to_execute" in command and \
                        command[command.index("--function_to_execute") + 1] == "train":
                    return [child, *child.children(recursive=True)]
        return []

    def _mirrored(self) -> bool:
        from cloob_core import storage
        from cloob_core.training import checkpoint

        folders = {path.rsplit("/checkpoints/", 1)[0] for path, _, _ in storage.tree_entries(self.workdir)
                   if "/checkpoints/" in path}
        return any(checkpoint.complete(storage.join(self.workdir, folder, "checkpoints")) for folder in folders)

    def _watch(self) -> None:
        import contextlib
        import time

        import psutil

        start = time.monotonic()
        while not self._stop.is_set() and not self.killed:
            step = self._step()
            if step:
                self.seen.setdefault("training", time.monotonic() - start)
                if self._mirrored():  # a checkpoint every 2 steps, polled every 0.1 s: the step still runs
                    self.seen.setdefault("mirrored", time.monotonic() - start)
                    for process in step:
                        with contextlib.suppress(psutil.Error):
                            command = " ".join(process.cmdline())[:200]
                            process.kill()
                            self.killed.append(command)
            self._stop.wait(0.1)


@pytest.mark.slow  # ~4 minutes: CI runs it (.ci/run), the default suite does not
def test_kfp_local_runs_the_whole_pipeline_on_the_packaged_default(tmp_path, s3_bucket, untrained_export, capsys):
    """With the manifest a folder of parquet parts on S3 and the shards on S3 (a real server on loopback): the
    partitions read their row groups and write there; two scoring partitions score the shards beside them, curate
    keeps the top 70%, and the gate and training stream the curated shards from there. The training step is killed
    (SIGKILL) once its first checkpoint is mirrored to the job workdir: kfp.local retries it, as Argo would an
    evicted pod, and the retry, in a fresh output folder, continues from that checkpoint instead of step 0. The
    evaluation is the short suite's two data sets (every task and aggregate of the default; its four sets: `dvc
    repro`'s test)."""
    import re

    import pyarrow as pa
    import pyarrow.parquet as pq
    import short_suite
    from kfp import local

    from cloob_core import storage
    from cloob_core.config.cluster import ClusterSettings
    from cloob_core.data.sources import packaged_frame
    from pipelines.local_run import kfp_local_state_kept
    from pipelines.pretrain import DEFAULT_PARAMS, build

    pairs, _ = packaged_frame("captioned", "train")  # the default's rows, as a crawl's folder of parts
    for index, start in enumerate(range(0, len(pairs), 768)):  # 3 parts of whole shards: the default's 8
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pandas(pairs.iloc[start:start + 768], preserve_index=False), sink)
        storage.write_bytes(f"s3://{s3_bucket}/crawl/part-{index:05d}.parquet", sink.getvalue().to_pybytes())
    params = json.loads(DEFAULT_PARAMS)
    params["acquire"]["source"] = f"s3://{s3_bucket}/crawl"
    params["train"].update(epochs=3.0, checkpoint_every=2)  # CI time; a checkpoint to resume from soon
    params["eval"]["datasets"] = short_suite.SUITE
    params["promote"]["store"] = str(tmp_path / "store")
    params["promote"]["min_first"] = {}  # a 3-epoch model becomes production
    # (an untrained scorer, at chance on the pool: the shard gate would refuse its cut, rightly)
    params["curation"].update(enabled=True, scorer=str(untrained_export), top_fraction=0.7, min_scorer_auc=0.0)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    settings = ClusterSettings(partitions=2, gpus=0, shards_store=f"s3://{s3_bucket}/shards", curation=True,
                               job_workdir=f"s3://{s3_bucket}/jobs", keep_checkpoints=True, train_retries=1,
                               train_retry_backoff_s=0)
    # (kfp.local's steps, in threads, would leave this worker's print indented and a stale log handler)
    with kfp_local_state_kept(), TrainingKiller(settings.job_workdir) as killer:
        build(settings)(params=json.dumps(params))
    assert killer.killed, ("the training step was not killed while it ran", killer.seen)
    log = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # kfp.local's log (to stdout), without its colours
    ends = [line.split(" - ")[-1] for line in log.splitlines() if "Task 'train' finished with status" in line]
    assert ends == ["Task 'train' finished with status FAILURE", "Task 'train' finished with status SUCCESS"], (
        killer.killed, ends, log[-3000:])  # killed, then retried by kfp.local
    (report,) = (tmp_path / "root").glob("*/report/folder/metrics.json")
    metrics = json.loads(report.read_text())
    assert set(metrics) == {"captioned_zeroshot_retrieval", "captioned_diagnostics", "tuxpaint_linear_probe",
                            "tuxpaint_zeroshot_classification", "suite"}, sorted(metrics)
    assert set(metrics["suite"]) == {"zeroshot_acc1", "linear_probe_acc1", "retrieval_recall@1",
                                     "retrieval_recall@5"}
    collected = [json.loads(path.read_text())["artifacts"] for path in
                 sorted((tmp_path / "root").glob("*/for-loop-*/collect-dataset/executor_output.json"))]
    matrices = [out["confusion"]["artifacts"][0]["metadata"].get("confusionMatrix") for out in collected]
    # one per classification set (tuxpaint's 15 classes); the retrieval set (captioned) leaves its artifact empty
    assert sorted(len(m["rows"]) if m else 0 for m in matrices) == [0, 15]
    (trained_metrics,) = (tmp_path / "root").glob("*/train/model/metrics.json")
    trained_run = json.loads(trained_metrics.read_text())
    assert trained_run["resumed_from_step"] >= 2, trained_run  # from the mirrored checkpoint, not from step 0
    (trained,) = (tmp_path / "root").glob("*/train/executor_output.json")
    curated = json.loads(trained.read_text())["artifacts"]["model"]["artifacts"][0]["metadata"]["shards"]
    shards = curated.removesuffix(".curated")  # the model's data lineage: the curated shards beside the pool
    assert shards.startswith(f"s3://{s3_bucket}/shards/shards-") and curated == f"{shards}.curated"
    assert sum(storage.read_json(f"{shards}/sizes.json").values()) == 2046  # 2 partitions, one folder; 1 too_small
    assert len(storage.list_names(shards, ".tar")) == 8
    assert sum(storage.read_json(f"{curated}/sizes.json").values()) == 1433  # the top 70%, rounded up
    records = [path for path, _, _ in storage.tree_entries(f"{shards}.scores") if path.endswith(".json")
               and "/parts/" in path]  # MODEL/parts/NNNNN.json: a part per shard, in one model's folder
    assert len(records) == 8 and len({path.split("/")[0] for path in records}) == 1, records
    assert "top_fraction" in next((tmp_path / "root").glob("*/curate/report")).read_text()
    assert not list((tmp_path / "root").rglob("*.tar"))  # and no step's folder holds a copy
    mirrored = [path for path, _, _ in storage.tree_entries(f"s3://{s3_bucket}/jobs")]
    # a retry of training resumes from them (kept here: by default a succeeded run's are deleted)
    assert any("/checkpoints/step-" in path for path in mirrored), mirrored
    (page,) = (tmp_path / "root").glob("*/report/page")
    assert page.read_text().startswith("# Evaluation report")
    pointer = json.loads((tmp_path / "store" / "production.json").read_text())  # promoted: the first model
    assert pointer["metrics"]["suite.retrieval_recall@5"] == metrics["suite"]["retrieval_recall@5"]
    # (the scheduled evaluation pipeline that re-evaluates a production model: tests/test_eval_suite_pipelines.py)


def fan_out(spec: dict) -> tuple[dict, dict]:
    """The evaluation's two loops: over the data sets the suite plans, and over the tasks of each."""
    loops = [task for component in (spec["root"], *spec["components"].values())
             for task in component.get("dag", {}).get("tasks", {}).values() if "parameterIterator" in task]
    over_sets = next(loop for loop in loops if loop["inputs"]["parameters"].get(
        loop["parameterIterator"]["items"].get("inputParameter", ""), {}).get("taskOutputParameter", {})
        .get("producerTask") == "plan-evaluation")
    over_tasks = next(loop for loop in loops if loop["inputs"]["parameters"].get(
        loop["parameterIterator"]["items"].get("inputParameter", ""), {}).get("taskOutputParameter", {})
        .get("producerTask") == "prepare-features")
    return over_sets, over_tasks


@pytest.mark.parametrize("pipeline", ["pretrain", "evaluate"])
def test_the_evaluation_fans_out_over_the_suite_of_the_params_run_parameter(tmp_path, pipeline):
    from pipelines.__main__ import main

    path = tmp_path / "pipeline.yaml"
    assert main(["compile", "--pipeline", pipeline, "--output", str(path)]) == 0
    spec = next(yaml.safe_load_all(path.read_text()))
    tasks = tasks_of(spec)
    # the suite comes from the run's params, so a recurring run can name another without recompiling
    assert tasks["plan-evaluation"]["inputs"]["parameters"]["params"] == {"componentInputParameter": "params"}
    assert "params" in spec["root"]["inputDefinitions"]["parameters"]
    over_sets, over_tasks = fan_out(spec)
    sets_body = spec["components"][over_sets["componentRef"]["name"]]["dag"]["tasks"]
    tasks_body = spec["components"][over_tasks["componentRef"]["name"]]["dag"]["tasks"]
    assert {"prepare-features", "collect-dataset"} <= set(sets_body) and set(tasks_body) == {"evaluate"}
    evaluate = tasks_body["evaluate"]["inputs"]
    prepare = sets_body["prepare-features"]["inputs"]
    assert prepare["parameters"]["dataset"]["componentInputParameter"] == over_sets["parameterIterator"]["itemInput"]
    assert evaluate["parameters"]["task"]["componentInputParameter"] == over_tasks["parameterIterator"]["itemInput"]
    # a data set's task steps read the features its one prepare-features step computed (and named)
    shared = over_tasks["inputs"]["artifacts"][evaluate["artifacts"]["features"]["componentInputArtifact"]]
    assert shared["taskOutputArtifact"] == {"outputArtifactKey": "features", "producerTask": "prepare-features"}
    collected = sets_body["collect-dataset"]["inputs"]["artifacts"]["parts"]["taskOutputArtifact"]
    assert collected["producerTask"] == over_tasks["taskInfo"]["name"]
    report = tasks["report"]["inputs"]["artifacts"]["datasets"]["taskOutputArtifact"]
    assert report["producerTask"] == over_sets["taskInfo"]["name"]
    outputs = spec["components"]["comp-collect-dataset"]["outputDefinitions"]["artifacts"]
    assert outputs["confusion"]["artifactType"]["schemaTitle"] == "system.ClassificationMetrics"  # one per set


def test_the_evaluation_pipeline_reads_production_and_records_its_metrics(tmp_path):
    from pipelines.__main__ import main

    path = tmp_path / "evaluate.yaml"
    assert main(["compile", "--pipeline", "evaluate", "--output", str(path)]) == 0
    spec = next(yaml.safe_load_all(path.read_text()))
    tasks = tasks_of(spec)
    assert {"production-model", "report", "record-production-metrics"} <= set(tasks)
    assert "report" in tasks["record-production-metrics"]["dependentTasks"]
    over_sets, _ = fan_out(spec)
    assert "production-model" in over_sets["dependentTasks"]
    assert tasks["prepare-features"]["inputs"]["artifacts"]["model"]["componentInputArtifact"] in \
        over_sets["inputs"]["artifacts"]


ON_S3 = ["--set", "promote.store=s3://cloob/registry"]  # a store a pod can reach


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    from pipelines.__main__ import main

    path = tmp_path_factory.mktemp("package") / "pipeline.yaml"
    # bounded below a day: the nightly schedules below would otherwise be refused (check_schedule_fits)
    assert main(["compile", "--output", str(path), "--job-timeout-s", "72000", "--run-timeout-s", "82800"]) == 0
    return path


def test_submit_sends_the_compiled_pipeline_and_the_validated_configuration(package, capsys):
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main

    with KfpApiServer() as api:
        assert main(["submit", "--host", api.url, "--package", str(package), "--experiment", "cloob-ci",
                     "--run-name", "retrain-1", "--params", str(REPO / "params.yaml"), "--set",
                     "train.objective=clip", "--no-cache", *ON_S3]) == 0
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


def test_what_a_cluster_cannot_use_is_refused_or_named_before_anything_is_sent(package, tmp_path, capsys):
    """Local paths no pod can read, a crontab's five fields, images without a registry: each one line, and
    nothing reaches the endpoint but what passed."""
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main

    base = ["--package", str(package), "--params", str(REPO / "params.yaml")]
    with KfpApiServer() as api:
        submit = ["submit", "--host", api.url, "--run-name", "x", *base]
        assert main(submit) == 2  # the repository's params.yaml keeps its model store in a local folder
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["pipelines: a pod cannot read this machine's files: promote.store 'models/registry'; put them "
                       "on S3 (s3://…) and name them there (--set KEY=s3://…)"], err
        local = ["--set", "acquire.source=/home/me/products.csv", "--set",
                 "eval.datasets.mine={source: data/photos, tasks: [zeroshot], classnames: my-classes.json}"]
        assert main([*submit, *ON_S3, *local]) == 2
        line = capsys.readouterr().err.strip()
        for named in ("acquire.source '/home/me/products.csv'", "eval.datasets.mine.source 'data/photos'",
                      "eval.datasets.mine.classnames 'my-classes.json'"):
            assert named in line
        assert "promote.store" not in line and "\n" not in line
        schedule = ["schedule", "create", "--host", api.url, "--name", "nightly", *base, *ON_S3]
        assert main([*schedule, "--cron", "0 3 * * *"]) == 2
        assert "'0 3 * * *' has 5 fields; KFP's cron has six, seconds first: '0 0 3 * * *'" in capsys.readouterr().err
        assert main([*schedule, "--cron", "0 0 3 * * * *"]) == 2
        assert "not a six-field cron expression" in capsys.readouterr().err
        assert not api.calls("POST", "/apis/v2beta1/runs") and not api.calls("POST", "/apis/v2beta1/recurringruns")
        assert main([*submit, *ON_S3]) == 0  # S3 everywhere: sent, with a warning on the images
        assert "name no registry" in capsys.readouterr().err
    registered = tmp_path / "registered.yaml"
    assert main(["compile", "--output", str(registered), "--registry", "registry.example:5000/ml"]) == 0
    assert "warning" not in capsys.readouterr().err
    executors = next(yaml.safe_load_all(registered.read_text()))["deploymentSpec"]["executors"]
    images = {executor["container"]["image"] for executor in executors.values()}
    assert images == {f"registry.example:5000/ml/cloob-pipelines:{image_tag()}-cpu",
                      f"registry.example:5000/ml/cloob-pipelines:{image_tag()}-cuda"}


@pytest.mark.parametrize("data", ["acquire", "import"])
def test_no_data_gate_is_skipped_by_kfps_cache(tmp_path, data):
    """The gates read locations whose contents change under the same name (a grown crawl's shards folder): a
    cached verdict would let new data reach training unchecked, so KFP's cache is off for them."""
    extra = ("--data", "import") if data == "import" else ()
    tasks = tasks_of(compile_with(tmp_path, *extra)["spec"])
    gates = [name for name in tasks if name.startswith("validate-")]
    assert gates == (["validate-manifest", "validate-shards"] if data == "acquire" else ["validate-shards"])
    for name in [*gates, "plan-evaluation"]:  # the evaluation plan checks that each entry's source is there now
        assert not tasks[name].get("cachingOptions", {}).get("enableCache"), name
    assert tasks["report"]["cachingOptions"]["enableCache"]  # what may be cached is


def test_a_registry_and_an_image_variable_together_are_refused_not_one_silently_dropped(tmp_path, monkeypatch,
                                                                                      capsys):
    from pipelines.__main__ import main

    monkeypatch.setenv("CLOOB_IMAGE_CPU", "mirror.example/cloob:cpu")
    assert main(["compile", "--output", str(tmp_path / "p.yaml"), "--registry", "ghcr.io/acme"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pipelines: --registry ghcr.io/acme and CLOOB_IMAGE_CPU both name the steps' images: give one", err
    assert not (tmp_path / "p.yaml").exists()


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
                     "--name", "nightly-retrain", "--cron", "0 0 3 * * *", *ON_S3]) == 0
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


def test_a_gpu_pod_gets_cuda_bf16_and_workers_and_streams_from_the_cpus_it_requests(compiled, monkeypatch):
    """What the one-pod training step of a pipeline compiled for 4 GPUs runs with: 44 CPUs requested (11 per GPU)
    and given to the thread budget, the default params' auto settings, which on that pod resolve to CUDA (one line
    if it is unusable), bf16, and per rank 8 workers over 16 streams (12 cores each; a batch of 128 in 64 streams)."""
    import torch

    from cloob_core.config import config_from_mapping
    from cloob_core.devices import resolve_precision
    from cloob_core.ops import launch
    from cloob_core.training.shape import RunShape, run_shape

    spec = compiled["spec"]
    container = spec["deploymentSpec"]["executors"]["exec-train"]["container"]
    assert container["resources"]["resourceCpuRequest"] == "44"
    assert {"name": "LOKY_MAX_CPU_COUNT", "value": "44"} in container["env"]
    params = json.loads(spec["root"]["inputDefinitions"]["parameters"]["params"]["defaultValue"])
    train = params["train"]
    assert (train["device"], train["precision"], train["workers"], train["data_streams"]) == ("auto",) * 4
    on_the_pod = launch.on_gpus(config_from_mapping(params), 4).train
    assert on_the_pod.device == "cuda"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision(on_the_pod.precision, torch.device("cuda", 0)) == "bf16"
    assert run_shape(on_the_pod, device_type="cuda", ranks=4, cores_per_rank=48 // 4, shards=1000) == RunShape(64, 8)


def compile_with(tmp_path: Path, *options: str) -> dict:
    from pipelines.__main__ import main

    path = tmp_path / "pipeline.yaml"
    assert main(["compile", "--output", str(path), *options]) == 0
    documents = list(yaml.safe_load_all(path.read_text()))
    return {"spec": documents[0], "platform": documents[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]}


def test_multi_node_training_is_a_training_operator_job_watched_by_a_small_pod(tmp_path):
    compiled = compile_with(tmp_path, "--nodes", "4", "--gpus", "8", "--job-kind", "trainjob", "--job-workdir",
                            "s3://team/jobs", "--node-selector", "pool=h100")
    spec, platform = compiled["spec"], compiled["platform"]
    tasks = tasks_of(spec)
    assert "train" not in tasks and "train-multinode" in tasks
    watcher = tasks["train-multinode"]
    assert "validate-shards" in watcher["dependentTasks"]
    job = json.loads(watcher["inputs"]["parameters"]["job"]["runtimeValue"]["constant"])
    assert (job["job_kind"], job["nodes"], job["gpus"], job["job_workdir"]) == ("trainjob", 4, 8, "s3://team/jobs")
    assert job["node_selector"] == {"pool": "h100"} and job["image"] == f"cloob-pipelines:{image_tag()}-cuda"
    assert watcher["inputs"]["parameters"]["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    resources = spec["deploymentSpec"]["executors"]["exec-train-multinode"]["container"]["resources"]
    assert "accelerator" not in resources  # the GPUs belong to the job's pods, not to the watcher
    mapped = {entry["envVar"] for entry in platform["exec-train-multinode"]["secretAsEnv"][0]["keyToEnv"]}
    assert "AWS_SECRET_ACCESS_KEY" in mapped
    assert "train-multinode" in tasks["promote"]["dependentTasks"]


def test_the_import_variant_trains_on_shards_already_on_s3(tmp_path):
    spec = compile_with(tmp_path, "--data", "import")["spec"]
    tasks = tasks_of(spec)
    assert {"acquire", "download-partition", "merge-shards"}.isdisjoint(tasks)
    assert spec["root"]["inputDefinitions"]["parameters"]["shards_uri"]["parameterType"] == "STRING"
    for step in ("validate-shards", "train"):  # imported data passes the same gate, read where it lies
        assert tasks[step]["inputs"]["parameters"]["shards"] == {"componentInputParameter": "shards_uri"}
    assert "validate-shards" in tasks["train"]["dependentTasks"]


def test_a_cluster_pipeline_needs_a_shards_store_its_pods_share(tmp_path, capsys):
    from pipelines.__main__ import main

    assert main(["compile", "--output", str(tmp_path / "p.yaml"), "--shards-store", str(tmp_path)]) == 2
    assert "shards_store must be an s3:// prefix the pods share" in capsys.readouterr().err
    assert not (tmp_path / "p.yaml").exists()


def _dvc(repo: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    assert done.returncode == 0, done.stderr


def test_a_dvc_tracked_folder_is_submitted_for_import_by_its_s3_uri(tmp_path, s3_bucket, capsys):
    """Shards versioned by DVC on a worktree remote (a versioned bucket) are imported where they lie, when the
    remote still holds the revision asked for; a content-addressed remote, whose objects the reader cannot use as
    a folder, and a revision the remote has moved past are refused with the fix, before anything is sent."""
    from kfp_api_server import KfpApiServer

    from cloob_core import storage
    from pipelines.__main__ import main

    storage.s3_client().put_bucket_versioning(Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"})
    repo = tmp_path / "repo"
    (repo / "data" / "shards").mkdir(parents=True)
    (repo / "data" / "shards" / "00000.tar").write_bytes(b"tar")
    (repo / "data" / "shards" / "sizes.json").write_text('{"00000.tar": 1}')
    git = ["git", "-c", "user.name=ci", "-c", "user.email=ci@localhost"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    _dvc(repo, "init", "-q")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    for name, prefix, worktree in (("tree", "layout", True), ("cas", "cache", False)):
        _dvc(repo, "remote", "add", name, f"s3://{s3_bucket}/{prefix}")
        _dvc(repo, "remote", "modify", name, "endpointurl", endpoint)
        if worktree:
            _dvc(repo, "remote", "modify", name, "worktree", "true")

    def version(tag: str) -> None:
        _dvc(repo, "add", "-q", "data/shards")
        for name in ("tree", "cas"):
            _dvc(repo, "push", "-q", "-r", name)
        subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
        subprocess.run([*git, "commit", "-qm", tag], cwd=repo, check=True)
        subprocess.run(["git", "tag", tag], cwd=repo, check=True)

    version("v1")
    assert storage.list_names(f"s3://{s3_bucket}/layout/data/shards") == ["00000.tar", "sizes.json"]
    package = tmp_path / "imported.yaml"
    assert main(["compile", "--data", "import", "--output", str(package)]) == 0
    with KfpApiServer() as api:
        common = ["submit", "--host", api.url, "--package", str(package), "--run-name", "from-dvc", "--params",
                  str(REPO / "params.yaml"), "--dvc-path", "data/shards", "--dvc-repo", str(repo), *ON_S3]
        assert main([*common, "--dvc-remote", "tree", "--dvc-rev", "v1"]) == 0
        (run,) = api.calls("POST", "/apis/v2beta1/runs")
        assert run["body"]["runtime_config"]["parameters"]["shards_uri"] == f"s3://{s3_bucket}/layout/data/shards"
        assert main([*common, "--dvc-remote", "cas"]) == 2
        assert "worktree true" in capsys.readouterr().err

        (repo / "data" / "shards" / "00000.tar").write_bytes(b"tar, rebuilt")
        version("v2")
        assert main([*common, "--dvc-remote", "tree", "--dvc-rev", "v1"]) == 2  # the remote holds v2 now
        assert "1 of 2 files differ, e.g. 00000.tar" in capsys.readouterr().err
        assert main([*common, "--dvc-remote", "tree", "--dvc-rev", "v2"]) == 0
        assert len(api.calls("POST", "/apis/v2beta1/runs")) == 2  # nothing sent for the refused ones


def test_key_value_flags_keep_their_values_as_text(tmp_path):
    """`--rdma-resources rdma/rdma_shared_device_a=1`, `--nccl-env NCCL_IB_DISABLE=0`, `--node-selector a=1`: the
    documented KEY=VALUE forms reach the pods as the text written, not refused as numbers."""
    compiled = compile_with(tmp_path, "--nodes", "2", "--gpus", "8", "--rdma-resources", "rdma/rdma_shared_device_a=1",
                            "--nccl-env", "NCCL_IB_DISABLE=0", "--node-selector", "a=1", "--nccl-env",
                            '{"NCCL_IB_HCA": "mlx5", "NCCL_NET_GDR_LEVEL": 2}')
    watcher = tasks_of(compiled["spec"])["train-multinode"]
    job = json.loads(watcher["inputs"]["parameters"]["job"]["runtimeValue"]["constant"])
    assert job["rdma_resources"] == {"rdma/rdma_shared_device_a": "1"} and job["node_selector"] == {"a": "1"}
    assert job["nccl_env"]["NCCL_IB_DISABLE"] == "0" and job["nccl_env"]["NCCL_NET_GDR_LEVEL"] == "2"


def test_a_metrics_port_a_node_agent_holds_is_refused_on_the_host_network(tmp_path, capsys):
    """With --host-network the pods' metrics port is the node's: dcgm-exporter's 9400 (the default before) failed
    the run at its first step with Errno 98; now the default is free and a clash is refused at compile time."""
    from pipelines.__main__ import main

    multi = ["compile", "--output", str(tmp_path / "p.yaml"), "--nodes", "2", "--gpus", "8", "--host-network"]
    assert main([*multi, "--metrics-port", "9400"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "metrics_port 9400 is NVIDIA dcgm-exporter's port on the node" in err, err
    compiled = compile_with(tmp_path, *multi[3:])
    job = json.loads(tasks_of(compiled["spec"])["train-multinode"]["inputs"]["parameters"]["job"]["runtimeValue"]
                     ["constant"])
    assert job["metrics_port"] == 9401 and job["host_network"] is True


def test_every_cluster_setting_reaches_the_one_node_training_step_or_is_refused(tmp_path, capsys):
    """One node: the NCCL settings reach the training pod's environment; the host network, RDMA devices and a
    job service account, which no KFP step can take, are refused in one line instead of dropped."""
    from pipelines.__main__ import main

    compiled = compile_with(tmp_path, "--gpus", "8", "--nccl-env", "NCCL_SOCKET_IFNAME=eth0")
    capsys.readouterr()  # the warning on images without a registry
    env = {e["name"]: e["value"] for e in compiled["spec"]["deploymentSpec"]["executors"]["exec-train"]["container"]
           ["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    for flags, named in ((["--host-network"], "host_network"), (["--service-account", "cloob-pipeline"],
                                                                  "service_account"),
                         (["--rdma-resources", "rdma/x=1"], "rdma_resources")):
        assert main(["compile", "--output", str(tmp_path / "p.yaml"), "--gpus", "8", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "with nodes 1 these apply to no pod" in err and named in err, err


def test_the_one_node_training_step_is_retried_and_resumes_from_the_runs_checkpoints(tmp_path):
    compiled = compile_with(tmp_path, "--gpus", "8", "--job-workdir", "s3://team/jobs", "--train-retries", "5")
    train = tasks_of(compiled["spec"])["train"]
    assert train["retryPolicy"]["maxRetryCount"] == 5 and train["retryPolicy"]["backoffDuration"] == "60s"
    parameters = train["inputs"]["parameters"]
    assert parameters["workdir"]["runtimeValue"]["constant"] == "s3://team/jobs"
    assert parameters["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert compiled["platform"]["exec-train"]["activeDeadlineSeconds"] == "604800"  # job_timeout_s: each try bounded
    bounded = compile_with(tmp_path, "--gpus", "8", "--job-workdir", "s3://team/jobs", "--job-timeout-s", "3600")
    assert bounded["platform"]["exec-train"]["activeDeadlineSeconds"] == "3600"
    multi = compile_with(tmp_path, "--nodes", "2", "--gpus", "8")
    watcher = tasks_of(multi["spec"])["train-multinode"]
    assert watcher["retryPolicy"]["maxRetryCount"] == 3  # a retried watcher adopts the running job
    platform = multi["platform"]["exec-train-multinode"]
    fields = {entry["name"]: entry["fieldPath"] for entry in platform["fieldPathAsEnv"]}
    # the job's owner and what says whether the run was stopped: the run's Workflow, named by Argo's pod label
    assert fields["CLOOB_WORKFLOW"] == "metadata.labels['workflows.argoproj.io/workflow']"
    annotations = platform["podMetadata"]["annotations"]  # a consolidation does not evict it mid-watch
    assert annotations == {"karpenter.sh/do-not-disrupt": "true",
                           "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}


def test_schedules_refuse_a_second_of_the_same_name_and_impossible_times(package, capsys):
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main

    with KfpApiServer() as api:
        create = ["schedule", "create", "--host", api.url, "--experiment", "nightly", "--package", str(package),
                  "--params", str(REPO / "params.yaml"), "--name", "nightly-retrain", *ON_S3]
        for cron, named in (("0 0 25 * * *", "hours '25' is outside 0-23"), ("0 61 3 * * *", "minutes '61'"),
                            ("0 0 3 * * 7", "day of week '7' is outside 0-6"), ("0 */0 3 * * *", "step '0'"),
                            ("0 0 3 31 FOO *", "month 'FOO'"),
                            ("0 0 3 31 2 *", "never fires: no date has that day of the month and month"),
                            ("@every 0s", "give @every a period of at least 1s"),
                            ("0 0 * * * *", "may train for up to 20.0 h (its job_timeout_s), as long as or longer "
                                            "than the schedule's period of 1.0 h")):
            assert main([*create, "--cron", cron]) == 2
            assert named in capsys.readouterr().err
        assert not api.recurring
        assert main([*create, "--cron", "0 0 3 * * MON-FRI"]) == 0
        (first,) = api.recurring
        assert main([*create, "--cron", "0 0 4 * * *"]) == 2
        err = capsys.readouterr().err
        assert f"already has a recurring run named 'nightly-retrain' ({first})" in err and "--replace" in err
        assert list(api.recurring) == [first]
        assert main([*create, "--cron", "@daily", "--replace", "--service-account", "cloob-pipeline"]) == 0
        (second,) = api.recurring
        assert second != first and api.recurring[second]["trigger"]["cron_schedule"]["cron"] == "@daily"
        assert api.recurring[second]["service_account"] == "cloob-pipeline"


def test_a_refusal_never_prints_credentials_and_an_https_source_is_no_local_file(package, capsys):
    from kfp_api_server import KfpApiServer

    from pipelines.__main__ import main

    with KfpApiServer() as api:
        submit = ["submit", "--host", api.url, "--run-name", "x", "--package", str(package), "--params",
                  str(REPO / "params.yaml"), *ON_S3]
        assert main([*submit, "--set", "acquire.source=https://example.com/m.csv"]) == 0  # a pod can fetch it
        capsys.readouterr()
        assert main([*submit, "--set", "acquire.source=file://u:PASSW0RD@host/m.csv?sig=SIG9"]) == 2
        err = capsys.readouterr().err
        assert "acquire.source 'file://host/m.csv?sig=REDACTED'" in err and "PASSW0RD" not in err, err
        # before: kept verbatim in the run's parameters and every job pod's CLOOB_PARAMS
        source = "https://user:PASSW0RD@example.com/m.csv?token=TOK123"
        assert main([*submit, "--set", f"acquire.source={source}"]) == 2
        err = capsys.readouterr().err.strip()
    assert "\n" not in err and "PASSW0RD" not in err and "TOK123" not in err, err
    assert "credentials in a URL of the run's parameters" in err
    assert "acquire.source 'https://example.com/m.csv?token=REDACTED'" in err
    assert not api.calls("POST", "/apis/v2beta1/runs")[1:]  # only the first, credential-free run was sent


@pytest.mark.parametrize("pipeline", ["pretrain", "evaluate"])
def test_every_step_runs_as_the_images_user_pulls_with_the_secrets_given_and_requires_its_s3_secret(tmp_path,
                                                                                                   pipeline):
    """Pod Security "restricted" admits every step (non-root, the image's user); a private registry's pull secret
    reaches every step; the S3 secret's credentials are required, so a misspelled secret stops the pod before it
    runs, and only its endpoint is optional (AWS S3 has none)."""
    compiled = compile_with(tmp_path, "--pipeline", pipeline, "--gpus", "8", "--image-pull-secrets", "regcred",
                            "--image-pull-secrets", "mirror")
    executors = compiled["spec"]["deploymentSpec"]["executors"]
    assert set(compiled["platform"]) == set(executors)  # every step has its platform settings
    for name, platform in compiled["platform"].items():
        assert platform["securityContext"] == {"runAsUser": "10001", "runAsGroup": "10001", "runAsNonRoot": True}, name
        for secret in platform.get("secretAsEnv", []):
            keys = {entry["secretKey"] for entry in secret["keyToEnv"]}
            assert bool(secret.get("optional")) is (keys == {"AWS_ENDPOINT_URL"}), (name, secret)
        assert [secret["secretName"] for secret in platform["imagePullSecret"]] == ["regcred", "mirror"], name
    assert sum(1 for platform in compiled["platform"].values() if "secretAsEnv" in platform) >= 4


def test_every_evaluation_step_requests_resources_and_the_features_step_a_gpu(tmp_path):
    """`compile --pipeline evaluate --gpus 8 --nodes 2 --memory 256Gi --node-selector pool=h100`: no executor
    without requests; the features step on the GPU nodes with one GPU, the task steps on CPU pods."""
    compiled = compile_with(tmp_path, "--pipeline", "evaluate", "--gpus", "8", "--nodes", "2", "--memory", "256Gi",
                            "--node-selector", "pool=h100", "--job-workdir", "s3://w/jobs")
    executors = compiled["spec"]["deploymentSpec"]["executors"]
    for name, executor in executors.items():
        resources = executor["container"].get("resources") or {}
        assert resources.get("resourceCpuRequest") and resources.get("resourceMemoryRequest"), name
    features = executors["exec-prepare-features"]["container"]["resources"]
    assert features["accelerator"]["resourceCount"] == "1" and features["resourceCpuRequest"] == "11"
    assert compiled["platform"]["exec-prepare-features"]["nodeSelector"]["labels"] == {"pool": "h100"}
    assert "accelerator" not in executors["exec-evaluate"]["container"]["resources"]


@pytest.mark.parametrize("options", [[], ["--data", "import"], ["--nodes", "2", "--gpus", "8"],
                                     ["--pipeline", "evaluate"], ["--curation"]],
                         ids=["acquire", "import", "multinode", "evaluate", "curation"])
def test_every_step_requests_cpu_and_memory(tmp_path, options):
    """A step without requests runs BestEffort: evicted first, and refused where a quota demands requests (before:
    acquire, plan-download, download-partition, merge-shards and both gates had none). The download pods' memory
    is bounded (docs/scale.md), so limited too; acquire's spill gets a disk the scheduler accounts for."""
    compiled = compile_with(tmp_path, *options)
    executors = compiled["spec"]["deploymentSpec"]["executors"]
    for name, executor in executors.items():
        resources = executor["container"].get("resources", {})
        assert resources.get("resourceCpuRequest") and resources.get("resourceMemoryRequest"), name
    if options:
        return
    download = executors["exec-download-partition"]["container"]
    assert download["resources"]["resourceCpuRequest"] == "8"
    assert download["resources"]["resourceMemoryRequest"] == download["resources"]["resourceMemoryLimit"] == "2Gi"
    assert {"name": "LOKY_MAX_CPU_COUNT", "value": "8"} in download["env"]
    assert executors["exec-acquire"]["container"]["resources"]["resourceMemoryRequest"] == "2Gi"
    without = compile_with(tmp_path, "--spill-disk", "", "--download-memory", "3Gi")
    assert not any("genericEphemeralVolume" in executor for executor in without["platform"].values())
    assert without["spec"]["deploymentSpec"]["executors"]["exec-download-partition"]["container"]["resources"][
        "resourceMemoryLimit"] == "3Gi"


@pytest.mark.parametrize("flags, named", [
    (["--memory", "32GB"], "not a Kubernetes quantity: '32GB' (bytes are Gi or G, not GB)"),
    (["--shm", "lots"], "not a Kubernetes quantity: 'lots'"),
    (["--accelerator", "nvidia/gpu"], "not a device plugin's resource name: 'nvidia/gpu'"),
    (["--node-selector", "bad key!=x"], "not a label key: 'bad key!'"),
    (["--node-selector", "pool=not ok"], "not a label value: 'not ok'"),
    (["--download-memory", "2 gigs"], "not a Kubernetes quantity"),
])
def test_settings_a_cluster_would_refuse_are_refused_at_compile_time(tmp_path, capsys, flags, named):
    """Before, a 2-node compile took `--memory 32GB --shm lots --accelerator nvidia/gpu --node-selector 'bad
    key!=x'`, and the run failed after its download, then three retries."""
    from pipelines.__main__ import main

    assert main(["compile", "--output", str(tmp_path / "p.yaml"), "--nodes", "2", "--gpus", "8", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and named in err, err


@pytest.mark.parametrize("options", [[], ["--curation", "--nodes", "2", "--gpus", "8", "--job-kind", "trainjob"]],
                         ids=["one-node", "multinode-curation"])
def test_every_step_that_spills_has_a_disk_and_the_long_steps_survive_what_a_cluster_does(tmp_path, options):
    """Before, curate had no disk for its spill (20 GB to 1 TB at scale) where acquire had 40 GiB; the long CPU
    steps had no retry and no do-not-disrupt; only the watcher kept consolidation away from training; a deleted
    watcher pod (its node ends Error, which KFP's retry without a retryPolicy does not cover) left its job holding
    GPUs to the job's deadline; a training pod never scheduled waited for ever."""
    compiled = compile_with(tmp_path, "--spill-disk", "200Gi", *options)
    spec, platform = compiled["spec"], compiled["platform"]
    executors = spec["deploymentSpec"]["executors"]
    spilling = {"exec-acquire", "exec-validate-manifest"} | ({"exec-curate"} if "--curation" in options else set())
    for name in spilling:
        (volume,) = platform[name]["genericEphemeralVolume"]
        assert volume["mountPath"] == "/spill" and volume["size"] == "200Gi", name
        assert {"name": "CLOOB_SPILL_DIR", "value": "/spill"} in executors[name]["container"]["env"], name
    assert {name for name, executor in platform.items() if "genericEphemeralVolume" in executor} == spilling
    tasks = tasks_of(spec)
    long_steps = {"acquire", "validate-manifest", "merge-shards", "validate-shards"} | (
        {"curate"} if "--curation" in options else set())
    for task in long_steps:
        assert tasks[task]["retryPolicy"]["maxRetryCount"] == 2, task
    training = "train-multinode" if "--nodes" in options else "train"
    for step in {f"exec-{task}" for task in long_steps} | {f"exec-{training}"}:
        annotations = platform[step]["podMetadata"]["annotations"]
        assert annotations["karpenter.sh/do-not-disrupt"] == "true", step
        assert annotations["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false", step
    assert documents_config(tmp_path)["activeDeadlineSeconds"] == 30 * 86400  # the run's own deadline
    if "--nodes" not in options:
        assert "end-training-job" not in tasks
        compile_with(tmp_path, "--run-timeout-s", "0")  # none
        assert documents_config(tmp_path) == {}
        from cloob_core.config import ConfigError
        from cloob_core.config.cluster import ClusterSettings

        with pytest.raises(ConfigError, match=r"run_timeout_s \(3600\) must be above job_timeout_s \(7200\)"):
            ClusterSettings.from_flags({"run_timeout_s": 3600, "job_timeout_s": 7200})
        return
    ending = spec["root"]["dag"]["tasks"]["end-training-job"]
    assert ending["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"  # however the run ends
    assert ending["dependentTasks"] == ["exit-handler-1"] and set(spec["root"]["dag"]["tasks"]) == {
        "end-training-job", "exit-handler-1"}  # every other task inside the handler's scope
    job = json.loads(ending["inputs"]["parameters"]["job"]["runtimeValue"]["constant"])
    assert (job["job_kind"], job["nodes"]) == ("trainjob", 2)


def documents_config(tmp_path: Path) -> dict:
    """The compiled package's pipeline-level Kubernetes settings (kfp's PipelineConfig)."""
    documents = list(yaml.safe_load_all((tmp_path / "pipeline.yaml").read_text()))
    return documents[1]["platforms"]["kubernetes"].get("pipelineConfig", {})


def test_only_the_multi_node_steps_talk_as_the_training_account(tmp_path):
    """The Role over PyTorchJobs and TrainJobs is bound to cloob-pipeline alone; the watcher and the run's exit
    handler talk as it, with short-lived tokens bound to their pod (before: a legacy token Secret mounted), so the
    account every step runs as (pipeline-runner, shared by every pipeline in the namespace) needs no rights over
    training jobs."""
    from cloob_core.ops.trainjob import JOB_ACCOUNT_ENV, POD_NAME_ENV, POD_UID_ENV

    compiled = compile_with(tmp_path, "--nodes", "2", "--gpus", "8")
    executors, platform = compiled["spec"]["deploymentSpec"]["executors"], compiled["platform"]
    talking = {name for name, executor in executors.items()
               if {"name": JOB_ACCOUNT_ENV, "value": "cloob-pipeline"} in executor["container"].get("env", [])}
    assert talking == {"exec-train-multinode", "exec-end-training-job"}
    for step in talking:
        fields = {entry["name"]: entry["fieldPath"] for entry in platform[step]["fieldPathAsEnv"]}
        assert fields[POD_NAME_ENV] == "metadata.name" and fields[POD_UID_ENV] == "metadata.uid"  # tokens bound to it
    assert not any("secretAsVolume" in executor for executor in platform.values())
    without = compile_with(tmp_path, "--nodes", "2", "--gpus", "8", "--job-account", "")["spec"]
    assert not any(entry["name"] == JOB_ACCOUNT_ENV for executor in without["deploymentSpec"]["executors"].values()
                   for entry in executor["container"].get("env", []))


def test_every_step_carries_the_settings_pod_labels_and_annotations(tmp_path):
    compiled = compile_with(tmp_path, "--pod-labels", "team=vision", "--pod-annotations", "example.com/owner=ml")
    executors = compiled["spec"]["deploymentSpec"]["executors"]
    for name in executors:
        metadata = compiled["platform"][name]["podMetadata"]
        assert metadata["labels"]["team"] == "vision" and metadata["annotations"]["example.com/owner"] == "ml", name


def test_a_schedule_whose_runs_may_outlast_its_period_is_refused(tmp_path, capsys):
    """One run at a time and no catch-up: a nightly schedule of a package that may train for 7 days (the default
    job_timeout_s) would skip a week of nights behind one hung run, in silence. Refused before anything is sent."""
    from cloob_core.ops.cluster import cron_period_s
    from pipelines import client

    package = tmp_path / "pipeline.yaml"
    from pipelines.__main__ import main

    assert main(["compile", "--output", str(package)]) == 0
    assert client.training_bound_s(str(package)) == 7 * 86400
    with pytest.raises(Exception, match=r"may train for up to 168.0 h .* period of 24.0 h \(0 0 3 \* \* \*\).* "
                                        r"compile with --job-timeout-s below 86400"):
        client.check_schedule_fits(str(package), "0 0 3 * * *")
    # the whole run's deadline too: a data step that hangs (a pod never scheduled) blocks the schedule as long
    with pytest.raises(Exception, match=r"may run for up to 720.0 h \(its run_timeout_s\).* period of 672.0 h"):
        client.check_schedule_fits(str(package), "@monthly")  # 28 days at the shortest
    nightly = tmp_path / "nightly.yaml"
    assert main(["compile", "--output", str(nightly), "--job-timeout-s", "72000", "--run-timeout-s", "82800"]) == 0
    client.check_schedule_fits(str(nightly), "0 0 3 * * *")
    assert client.run_bound_s(str(nightly)) == 82800
    multi = tmp_path / "multi.yaml"
    assert main(["compile", "--output", str(multi), "--nodes", "2", "--gpus", "8", "--job-timeout-s", "3600"]) == 0
    assert client.training_bound_s(str(multi)) == 3600
    evaluation = tmp_path / "evaluate.yaml"
    assert main(["compile", "--pipeline", "evaluate", "--output", str(evaluation)]) == 0
    assert client.training_bound_s(str(evaluation)) is None
    assert cron_period_s("0 30 2 1 * MON-FRI") == 86400  # day of month or day of week, as robfig reads them
    assert cron_period_s("0 0 0 29 2 *") > 365 * 86400  # once every leap year


def test_steps_go_to_their_node_pools(tmp_path, capsys):
    """CPU steps to their own pool (before: anywhere, no way to steer them), the one-GPU features step by its own
    selector (before: the training selector, a whole 8-GPU node), GPU steps with every toleration and the node
    affinity, the one-node training pod in a Kueue queue; a priority class or scheduler no KFP step can take is
    refused in one line."""
    from pipelines.__main__ import main

    spot = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
    zone = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}]}}
    compiled = compile_with(tmp_path, "--gpus", "8", "--node-selector", "pool=h100", "--eval-node-selector",
                            "pool=l4", "--cpu-node-selector", "pool=cpu", "--cpu-tolerations", json.dumps([spot]),
                            "--tolerations", json.dumps([spot]), "--node-affinity", json.dumps(zone),
                            "--kueue-queue", "team-a")
    platform = compiled["platform"]
    gpu_steps = {"exec-train", "exec-prepare-features"}
    for name, executor in platform.items():
        selector = executor.get("nodeSelector", {}).get("labels", {})
        expected = {"exec-train": {"pool": "h100"}, "exec-prepare-features": {"pool": "l4"}}.get(name, {"pool": "cpu"})
        assert selector == expected, (name, selector)
        tolerations = json.dumps(executor.get("tolerations", []))
        assert '"spot"' in tolerations, name
        assert ("nvidia.com/gpu" in tolerations) == (name in gpu_steps), name
        assert ("nodeAffinity" in executor) == (name in gpu_steps), name
    assert platform["exec-train"]["podMetadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    capsys.readouterr()  # the warning on images without a registry
    for flags in (["--priority-class", "high"], ["--scheduler-name", "volcano"]):
        assert main(["compile", "--output", str(tmp_path / "p.yaml"), "--gpus", "8", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "a KFP step's pod cannot be given one" in err, err


def test_images_are_tagged_by_commit_and_pulled_if_not_present(tmp_path):
    """The tag 0.1.0 was rebuilt in place and no pull policy set: nodes could run stale or mixed code. A tag now
    names one build (version and commit) and every step pulls IfNotPresent."""
    import re

    compiled = compile_with(tmp_path, "--nodes", "2", "--gpus", "8")
    images = {executor["container"]["image"] for executor in compiled["spec"]["deploymentSpec"]["executors"].values()}
    assert all(re.fullmatch(r"cloob-pipelines:0\.1\.0-[0-9a-f]{12}-(cpu|cuda)", image) for image in images), images
    assert {executor["imagePullPolicy"] for executor in compiled["platform"].values()} == {"IfNotPresent"}
    job = json.loads(tasks_of(compiled["spec"])["train-multinode"]["inputs"]["parameters"]["job"]["runtimeValue"]
                     ["constant"])
    assert job["image_pull_policy"] == "IfNotPresent" and job["image"].endswith("-cuda")


def test_curation_scores_on_gpu_pods_curates_then_gates_and_trains_on_the_curated_shards(tmp_path):
    """With --curation: after the download, a loop over ranges of the shards scores them, one GPU pod each as the
    evaluation's features step gets; the curate step collects the loop; the shard gate and training read the
    curated shards. Without GPUs the scoring pods are CPU pods."""
    compiled = compile_with(tmp_path, "--curation", "--gpus", "4", "--node-selector", "pool=a100", "--partitions", "3",
                            "--scoring-parallelism", "5")
    spec, platform = compiled["spec"], compiled["platform"]
    tasks = tasks_of(spec)
    merged = {"taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "merge-shards"}}
    assert tasks["plan-scoring"]["inputs"]["parameters"]["shards"] == merged
    assert tasks["plan-scoring"]["inputs"]["parameters"]["most"]["runtimeValue"]["constant"] == 3
    loop = next(task for task in spec["root"]["dag"]["tasks"].values()
                if "plan-scoring" in task.get("parameterIterator", {}).get("items", {}).get("inputParameter", ""))
    assert loop["iteratorPolicy"]["parallelismLimit"] == 5
    assert tasks["score-partition"]["retryPolicy"]["maxRetryCount"] == 2
    scoring = spec["deploymentSpec"]["executors"]["exec-score-partition"]["container"]
    assert scoring["resources"]["accelerator"]["resourceCount"] == "1"
    assert scoring["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"
    assert scoring["resources"]["resourceCpuRequest"] == "11" and scoring["image"].endswith("-cuda")
    assert platform["exec-score-partition"]["tolerations"] == platform["exec-train"]["tolerations"]
    assert platform["exec-score-partition"]["nodeSelector"] == {"labels": {"pool": "a100"}}
    assert tasks["curate"]["inputs"]["parameters"]["parts"]["taskOutputParameter"]["producerTask"] == \
        loop["taskInfo"]["name"]
    curated = {"taskOutputParameter": {"outputParameterKey": "Output", "producerTask": "curate"}}
    for step in ("validate-shards", "train"):
        assert tasks[step]["inputs"]["parameters"]["shards"] == curated
    assert "validate-shards" in tasks["train"]["dependentTasks"]
    (tmp_path / "cpu").mkdir()
    cpu = compile_with(tmp_path / "cpu", "--curation", "--gpus", "0")
    resources = cpu["spec"]["deploymentSpec"]["executors"]["exec-score-partition"]["container"]["resources"]
    assert "accelerator" not in resources and resources["resourceCpuRequest"] == "4"
    assert "tolerations" not in cpu["platform"].get("exec-score-partition", {})
    (tmp_path / "plain").mkdir()
    assert "plan-scoring" not in tasks_of(compile_with(tmp_path / "plain")["spec"])  # off by default
