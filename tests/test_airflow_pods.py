"""mode kubernetes (pipelines/airflow_pods.py): each Airflow task's pod, as the provider's KubernetesPodOperator
renders it without a cluster (``build_pod_request_obj(dry_run=True)``, in Airflow's venv), equals the pod of the
compiled Kubeflow pipeline for the same cluster settings in every field that decides where and how the step runs:
image, the step it runs, requests and limits, GPUs, node selector, tolerations, affinity, environment, the S3
secret's keys, labels, annotations, the security context, volumes, deadline, pulls, retries. For every step of the
pretraining and re-evaluation pipelines, one node and two with GPUs, curation on and off. And what a task ends as,
with the provider's own code around the operator: a pod that left no record of having finished is no success
(apache/airflow #73006), exit 2 is not retried."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from airflow_harness import REPO, SIDE, VENV, airflow_env, settings_file

sys.path.insert(0, str(REPO))  # components/ and pipelines/ run from the repository root, uninstalled

from cloob_core.config.airflow import AirflowSettings
from cloob_core.ops import airflow_run, graph
from cloob_core.ops.trainjob import WORKFLOW_ENV

pytestmark = pytest.mark.airflow

PLACED = {"gpus": 4, "shards_store": "s3://b/shards", "job_workdir": "s3://b/jobs", "kueue_queue": "team-a",
          "node_selector": {"pool": "h100"}, "cpu_node_selector": {"pool": "cpu"},
          "cpu_tolerations": [{"key": "cpu", "operator": "Exists", "effect": "NoSchedule"}],
          "tolerations": [{"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
          "node_affinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
              {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}]}},
          "pod_labels": {"team": "ml"}, "pod_annotations": {"owner": "platform"},
          "image_pull_secrets": ["registry"], "spill_disk": "50Gi", "job_pending_timeout_s": 5400}
CASES = {
    "one node, 4 GPUs": {**PLACED},
    "one node, 4 GPUs, curation": {**PLACED, "curation": True, "eval_gpus": 1},
    "two nodes, 8 GPUs each": {**PLACED, "nodes": 2, "gpus": 8, "job_account": "cloob-trainer"},  # api_url too
    "two nodes, curation, imported shards": {**PLACED, "nodes": 2, "gpus": 8, "curation": True, "data": "import",
                                             "s3_secret": "team-s3", "image_pull_policy": "Always"},
}
# Only the Kubeflow pod has it: the name of the run's Argo Workflow, by which the multi-node watcher tells a
# stopped run from a drain there (ops/trainjob.py); under Airflow that is the run's own state (docs/airflow.md).
KFP_ONLY_ENV = {WORKFLOW_ENV}
# Only the Airflow pod has them: the task instance, the Airflow API and its credentials (ops/airflow_run.py).
AIRFLOW_ONLY_ENV = {airflow_run.TASK_ENV, airflow_run.API_ENV, *airflow_run.SECRET_KEYS}
API_URL = "http://airflow-api-server.airflow:8080"
# What the provider adds to every pod of its own: its labels (which task, which try) and the XCom sidecar's
# volume; the sidecar itself is checked apart.
PROVIDER_LABELS = {"dag_id", "task_id", "run_id", "try_number", "map_index", "kubernetes_pod_operator",
                   "airflow_version", "airflow_kpo_in_cluster"}


def _settings(values: dict) -> dict:
    api = {"api_url": API_URL, "api_secret": "airflow-api"} if values.get("job_account") else {}
    return {"mode": "kubernetes", "runs": "s3://b/airflow", **api, "cluster": values}


def _kfp_documents(tmp, values: dict) -> dict[str, list]:
    """Both Kubeflow pipelines compiled for the cluster settings the Airflow DAGs get from these values."""
    from kfp import compiler

    from pipelines.pretrain import build, build_evaluation

    cluster = AirflowSettings(**_settings(values)).located(REPO).cluster
    documents = {}
    for pipeline, made in (("pretrain", build(cluster)), ("evaluate", build_evaluation(cluster))):
        path = tmp / f"{pipeline}.yaml"
        compiler.Compiler().compile(made, str(path))
        documents[pipeline] = list(yaml.safe_load_all(path.read_text()))
    return documents


def _retry_policies(spec: dict) -> dict[str, dict]:
    policies = {}
    for dag in [spec["root"]["dag"], *(c["dag"] for c in spec["components"].values() if "dag" in c)]:
        for name, task in dag["tasks"].items():
            if "retryPolicy" in task:
                policies[name.replace("-", "_")] = task["retryPolicy"]
    return policies


def kfp_pod(document: list, step: str) -> dict:
    """The step's pod in the compiled Kubeflow pipeline, in the form both fronts are compared in."""
    executor = f"exec-{step.replace('_', '-')}"
    container = document[0]["deploymentSpec"]["executors"][executor]["container"]
    platform = document[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"].get(executor, {})
    resources = container.get("resources", {})
    accelerator = resources.get("accelerator")
    limits = {**({"memory": resources["resourceMemoryLimit"]} if "resourceMemoryLimit" in resources else {}),
              **({accelerator["resourceType"]: accelerator["resourceCount"]} if accelerator else {})}
    env = {e["name"]: ("value", e["value"]) for e in container.get("env", [])}
    env |= {e["name"]: ("field", e["fieldPath"]) for e in platform.get("fieldPathAsEnv", [])}
    env |= {k["envVar"]: ("secret", s["secretName"], k["secretKey"], bool(s.get("optional")))
            for s in platform.get("secretAsEnv", []) for k in s["keyToEnv"]}
    context = platform["securityContext"]
    metadata = platform.get("podMetadata", {})
    volumes = {v["mountPath"]: ("memory", v["sizeLimit"]) for v in platform.get("emptyDirMounts", [])
               if v.get("medium") == "Memory"}
    volumes |= {v["mountPath"]: ("ephemeral", tuple(v["accessModes"]), v["size"])
                for v in platform.get("genericEphemeralVolume", [])}
    retry = _retry_policies(document[0]).get(step)
    return {
        "image": container["image"], "runs": container["args"][container["args"].index("--function_to_execute") + 1],
        "requests": {"cpu": resources["resourceCpuRequest"], "memory": resources["resourceMemoryRequest"]},
        "limits": limits, "env": {k: v for k, v in env.items() if k not in KFP_ONLY_ENV},
        "node_selector": platform.get("nodeSelector", {}).get("labels", {}),
        "tolerations": platform.get("tolerations", []),
        "affinity": [a["nodeAffinityJson"]["runtimeValue"]["constant"] for a in platform.get("nodeAffinity", [])],
        "labels": metadata.get("labels", {}), "annotations": metadata.get("annotations", {}),
        "user": (int(context["runAsUser"]), int(context["runAsGroup"]), context["runAsNonRoot"]),
        "volumes": volumes, "deadline_s": int(platform["activeDeadlineSeconds"]) if "activeDeadlineSeconds" in
        platform else None, "pull": (platform.get("imagePullPolicy"),
                                     [s["secretName"] for s in platform.get("imagePullSecret", [])]),
        "retry": (retry["maxRetryCount"], float(retry["backoffDuration"].rstrip("s")), retry["backoffFactor"],
                  float(retry["backoffMaxDuration"].rstrip("s"))) if retry else (0, 0.0, 0.0, None)}


def airflow_pod(rendered: dict, step: str) -> dict:
    """The step's pod as the Airflow task renders it, in the same form."""
    pod, spec = rendered["pod"], rendered["pod"]["spec"]
    (base,) = [c for c in spec["containers"] if c["name"] == "base"]
    env = {}
    for variable in base.get("env", []):
        source = variable.get("valueFrom")
        if source is None:
            env[variable["name"]] = ("value", variable["value"])
        elif "fieldRef" in source:
            env[variable["name"]] = ("field", source["fieldRef"]["fieldPath"])
        else:
            ref = source["secretKeyRef"]
            env[variable["name"]] = ("secret", ref["name"], ref["key"], bool(ref.get("optional")))
    mounts = {m["name"]: m["mountPath"] for m in base.get("volumeMounts", [])}
    volumes = {}
    for volume in spec.get("volumes", []):
        if "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory":
            volumes[mounts[volume["name"]]] = ("memory", volume["emptyDir"]["sizeLimit"])
        elif "ephemeral" in volume:
            claim = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
            volumes[mounts[volume["name"]]] = ("ephemeral", tuple(claim["accessModes"]),
                                               claim["resources"]["requests"]["storage"])
    context = spec["securityContext"]
    resources = base.get("resources", {})
    affinity = spec.get("affinity", {}).get("nodeAffinity")
    return {
        "image": base["image"], "runs": step if base["command"] == ["python", "-m", "cloob_core.ops.task_runner"]
        else base["command"], "requests": resources.get("requests", {}), "limits": resources.get("limits", {}),
        "env": {k: v for k, v in env.items() if k not in AIRFLOW_ONLY_ENV},
        "node_selector": spec.get("nodeSelector", {}), "tolerations": spec.get("tolerations", []),
        "affinity": [affinity] if affinity else [],
        "labels": {k: v for k, v in pod["metadata"].get("labels", {}).items() if k not in PROVIDER_LABELS},
        "annotations": pod["metadata"].get("annotations") or {},
        "user": (context["runAsUser"], context["runAsGroup"], context["runAsNonRoot"]), "volumes": volumes,
        "deadline_s": spec.get("activeDeadlineSeconds"),
        "pull": (base.get("imagePullPolicy"), [s["name"] for s in spec.get("imagePullSecrets", [])]),
        "retry": (rendered["retries"], rendered["retry_delay_s"], float(rendered["backoff"]),
                  rendered["max_retry_delay_s"] if rendered["retries"] else None)}


@pytest.fixture(scope="module")
def rendered(airflow_venv, tmp_path_factory) -> dict:
    """Every case's pods as the Airflow tasks render them, and the outcomes, from one run in Airflow's venv."""
    tmp = tmp_path_factory.mktemp("pods")
    cases = tmp / "cases.json"
    cases.write_text(json.dumps({case: _settings(values) for case, values in CASES.items()}))
    out = tmp / "pods.json"
    done = subprocess.run([str(VENV / "bin" / "python"), str(SIDE / "pod_report.py"), str(cases), str(out)],
                          env=airflow_env(tmp / "home", settings_file(tmp, {})), capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_each_airflow_pod_is_the_kubeflow_pipelines_pod_for_the_same_settings(rendered, tmp_path, case):
    values = CASES[case]
    documents = _kfp_documents(tmp_path, values)
    cluster = AirflowSettings(**_settings(values)).located(REPO).cluster
    steps = rendered["cases"][case]["steps"]
    compared = 0
    for pipeline in ("pretrain", "evaluate"):
        for step in graph.graph(pipeline, cluster):
            kfp, airflow = kfp_pod(documents[pipeline], step.name), airflow_pod(steps[step.name], step.name)
            assert airflow == kfp, (step.name, {key: (airflow[key], kfp[key]) for key in kfp
                                                if airflow[key] != kfp[key]})
            compared += 1
            # what the Kubeflow driver leaves to the namespace, the Airflow pod says itself: Pod Security's
            # "restricted" for the step and the XCom sidecar, which runs the step's image, not Docker Hub's alpine
            pod = steps[step.name]["pod"]["spec"]
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, step.name
            for container in pod["containers"]:
                assert container["image"] == kfp["image"], (step.name, container["name"])
                assert container["securityContext"] == {
                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                    "runAsUser": 10001, "runAsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}, \
                    (step.name, container["name"])
            # a GPU node may take as long to come as the settings say, not the provider's 120 s
            assert steps[step.name]["startup_timeout_s"] == steps[step.name]["schedule_timeout_s"] == 5400
    assert compared >= (14 if "curation" in case else 11), compared
    classes = rendered["cases"][case]["classes"]
    assert {name: kind for name, kind in classes.items() if not name.endswith(("suite_tasks", "production_moved"))
            } == {name: "PodStep" for name in classes if not name.endswith(("suite_tasks", "production_moved"))}


def test_a_pod_that_left_no_record_of_finishing_is_no_success_and_exit_2_is_not_retried(rendered):
    checks = rendered["checks"]
    finished = checks["finished"]
    assert finished["returned"] == {"model": "s3://b/model"}
    assert finished["cmds"] == ["python", "-m", "cloob_core.ops.task_runner"]
    step, _, inputs, _, output, _, result = finished["arguments"]
    assert (step, json.loads(inputs)["shards"], result) == ("train", "s3://b/shards", "/airflow/xcom/return.json")
    assert output == "s3://b/airflow/cloob_pretrain/manual__2026-12-03T10-00-00-00-00/train"
    # the provider returns from a SIGTERM'd pod as from a success (#73006): the missing record fails the task
    assert "left no record of having finished" in checks["no record"]["retry"]
    assert "left no record of having finished" in checks["another step's record"]["retry"]
    assert checks["exit 2"] == {"fail": "step train: cloob.train.steps: must be positive"}
    assert "returned a failure" in checks["exit 1"]["retry"]


def test_mode_kubernetes_needs_runs_on_storage_the_pods_share(tmp_path):
    from cloob_core.config.base import ConfigError

    with pytest.raises(ConfigError, match="runs must be an s3:// prefix the pods share, not 'runs/airflow'"):
        AirflowSettings.load(str(settings_file(tmp_path, {"mode": "kubernetes", "runs": "runs/airflow"})))


def test_the_multinode_watcher_is_told_its_airflow_task_and_how_to_reach_the_airflow_api(rendered):
    """What the watcher reads after a SIGTERM to tell a person's stop from a worker's restart (its Kubeflow pod
    names its Argo Workflow instead): the task instance, rendered when the task runs; the API server; the secret's
    keys, either pair optional (a user and password, or a token)."""
    for case, values in CASES.items():
        steps = rendered["cases"][case]["steps"]
        if values.get("nodes", 1) == 1:
            assert "train_multinode" not in steps, case
            continue
        (base,) = [c for c in steps["train_multinode"]["pod"]["spec"]["containers"] if c["name"] == "base"]
        variables = {variable["name"]: variable for variable in base["env"]}
        assert airflow_run.TASK_ENV in variables, case
        with_api = values.get("job_account") is not None
        assert (variables.get(airflow_run.API_ENV, {}).get("value") == API_URL) is with_api, case
        secrets = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in variables.values()
                   if v["name"] in airflow_run.SECRET_KEYS}
        assert secrets == ({key: {"name": "airflow-api", "key": key, "optional": True}
                            for key in airflow_run.SECRET_KEYS} if with_api else {}), case
    rendered_task = json.loads(rendered["checks"]["watcher env"][airflow_run.TASK_ENV])
    assert rendered_task == {"dag_id": "cloob_pretrain", "run_id": "manual__2026-12-03T10:00:00+00:00",
                             "task_id": "train", "map_index": -1}
