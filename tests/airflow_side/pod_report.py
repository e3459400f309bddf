"""Run in Airflow's venv (.venv-airflow) from the repository root: for each case of argv[1] (a JSON file: case ->
Airflow settings, mode kubernetes), every declared step's pod as KubernetesPodOperator renders it
(``build_pod_request_obj(dry_run=True)``, no cluster) with the task's retries, and the operator class of each task
of the case's DAGs; then, with the provider's own code around our operator, what a task ends as when its pod
ends: the command a run gives the pod, a pod that left no record of having finished (apache/airflow #73006), and
exit statuses 2 and 1, and the multi-node watcher's environment rendered for a run. JSON into argv[2]."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from kubernetes.client import ApiClient
from kubernetes.client import models as k8s

from cloob_core.config.airflow import AirflowSettings
from cloob_core.ops import graph
from pipelines.airflow_dags import dags
from pipelines.airflow_steps import step_operator

cases = json.loads(Path(sys.argv[1]).read_text())
report = {"cases": {}}
for case, values in cases.items():
    settings = AirflowSettings(**values).located(Path.cwd())
    steps = {step.name for pipeline in ("pretrain", "evaluate") for step in graph.graph(pipeline, settings.cluster)}
    rendered = {}
    for step in sorted(steps):
        task = step_operator(step, settings)(inputs={})
        rendered[step] = {"pod": ApiClient().sanitize_for_serialization(task.build_pod_request_obj(dry_run=True)),
                          "retries": task.retries, "retry_delay_s": task.retry_delay.total_seconds(),
                          "backoff": task.retry_exponential_backoff,
                          "max_retry_delay_s": task.max_retry_delay.total_seconds() if task.max_retry_delay else None,
                          "startup_timeout_s": task.startup_timeout_seconds,
                          "schedule_timeout_s": task.schedule_timeout_seconds}
    classes = {f"{dag_id}.{task.task_id}": getattr(task, "operator_class", type(task)).__name__
               for dag_id, dag in dags(AirflowSettings(**values)).items() for task in dag.tasks}
    report["cases"][case] = {"steps": rendered, "classes": classes}


def outcome(call):
    try:
        return {"returned": call()}
    except AirflowFailException as err:
        return {"fail": str(err)}
    except AirflowException as err:
        return {"retry": str(err)}


values = next(iter(cases.values()))
settings = AirflowSettings(**values).located(Path.cwd())


class TI:
    dag_id, task_id, map_index, run_id = "cloob_pretrain", "train", -1, "manual__2026-12-03T10:00:00+00:00"


context = {"ti": TI, "run_id": "manual__2026-12-03T10:00:00+00:00"}
seen = {}


def pod_ended(record):
    def execute(self, context):
        seen["cmds"], seen["arguments"] = self.cmds, self.arguments
        return record
    return execute


checks = {}
task = step_operator("train", settings)(inputs={"params": "{}", "shards": "s3://b/shards"})
KubernetesPodOperator.execute = pod_ended({"step": "train", "result": {"model": "s3://b/model"}})
checks["finished"] = {**outcome(lambda: task.execute(context)), **seen}
KubernetesPodOperator.execute = pod_ended(None)  # SIGTERM'd: the provider returns as from a success (#73006)
checks["no record"] = outcome(lambda: task.execute(context))
KubernetesPodOperator.execute = pod_ended({"step": "report", "result": {}})
checks["another step's record"] = outcome(lambda: task.execute(context))


def ended_with(code):
    remote = k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="cloob-train-x", namespace="default"),
                       status=k8s.V1PodStatus(phase="Failed", container_statuses=[k8s.V1ContainerStatus(
                           name="base", image="i", image_id="", ready=False, restart_count=0,
                           state=k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(
                               exit_code=code, message="loading the config\nstep train: cloob.train.steps: must be "
                                                       "positive\n"))),
                           k8s.V1ContainerStatus(name="airflow-xcom-sidecar", image="i", image_id="", ready=True,
                                                 restart_count=0)]))
    # no cluster: what the provider asks the API server around it (istio, a label, the deletion) is not under test
    task.is_istio_enabled = lambda *args, **kwargs: False
    task.process_pod_deletion = lambda *args, **kwargs: None
    task.patch_already_checked = lambda *args, **kwargs: None
    return outcome(lambda: task.cleanup(remote, remote))


checks["exit 2"], checks["exit 1"] = ended_with(2), ended_with(1)
several = next((values for values in cases.values() if values["cluster"].get("nodes", 1) > 1), None)
if several:  # the watcher's way to its Airflow run, as the task renders it when it runs
    watcher = step_operator("train_multinode", AirflowSettings(**several).located(Path.cwd()))(inputs={})
    watcher.render_template_fields(context)
    checks["watcher env"] = {variable.name: variable.value for variable in watcher.env_vars if variable.value}
report["checks"] = checks
Path(sys.argv[2]).write_text(json.dumps(report))
