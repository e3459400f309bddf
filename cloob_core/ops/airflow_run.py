"""Whether the Airflow run that a multi-node watcher serves was stopped, from Airflow's REST API (v2): the state
of the watcher's task instance and of its DAG run, as the Airflow API server keeps them.

Under Kubeflow the watcher asks the run's Argo Workflow (:mod:`cloob_core.ops.trainjob`); under Airflow there is
none. The watcher's pod is the task's (pipelines/airflow_pods.py): Airflow deletes it (KubernetesPodOperator's
``on_kill``) both when a person marks the task or its run failed, or clears it, and when the worker that runs the
task stops (a restart, a scheduler fail-over, an eviction), so a SIGTERM alone says nothing. Airflow records a
person's decision before it stops the task (the API server sets the state; the worker's next heartbeat is refused
and it kills the task), so the state read after the signal tells the two apart:

- the task instance ``failed``, ``success``, ``skipped``, ``upstream_failed`` or ``removed``, or the DAG run
  ``failed`` or ``success``: the run stopped, the job is deleted;
- the task instance ``restarting`` or without a state: a person cleared it, and the job is deleted (the next try
  starts a job of its own, from the run's checkpoints);
- anything else (``running``, ``up_for_retry``, ``queued``…): the run goes on, the job is left to the next try.

The pod reaches the API server at ``CLOOB_AIRFLOW_API`` and signs in with a user's name and password
(``POST /auth/token``, which the simple and the FAB auth managers both serve) or a token, from a Kubernetes secret
(``AirflowSettings.api_secret``); the user needs to read DAG runs and task instances (Airflow's Viewer role)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

TASK_ENV = "CLOOB_AIRFLOW_TASK"  # the task instance, as JSON: dag_id, run_id, task_id, map_index
API_ENV = "CLOOB_AIRFLOW_API"  # the API server's URL as the pods reach it
USERNAME_ENV, PASSWORD_ENV, TOKEN_ENV = "AIRFLOW_API_USERNAME", "AIRFLOW_API_PASSWORD", "AIRFLOW_API_TOKEN"
SECRET_KEYS = (USERNAME_ENV, PASSWORD_ENV, TOKEN_ENV)  # the api_secret's keys: a user and password, or a token
# The task instance's states after which nothing of this try goes on (Airflow's TaskInstanceState).
TASK_ENDED = frozenset({"failed", "success", "skipped", "upstream_failed", "removed"})
TASK_CLEARED = frozenset({"restarting", None})  # cleared while running; cleared and not yet scheduled again
RUN_ENDED = frozenset({"failed", "success"})  # DagRunState


class AirflowApiError(Exception):
    """A call to the Airflow API that failed: ``status`` is its HTTP status, 0 for no answer (the connection)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status} {reason}".strip() if status else reason)
        self.status = status


def task_from_env() -> dict[str, Any] | None:
    """The task instance this pod runs for, from ``CLOOB_AIRFLOW_TASK``; None outside an Airflow task's pod."""
    text = os.environ.get(TASK_ENV)
    if not text:
        return None
    try:
        task = json.loads(text)
        return {"dag_id": str(task["dag_id"]), "run_id": str(task["run_id"]), "task_id": str(task["task_id"]),
                "map_index": int(task.get("map_index", -1))}
    except (ValueError, KeyError, TypeError):
        return None


def describe(task: dict[str, Any]) -> str:
    index = f"[{task['map_index']}]" if task["map_index"] >= 0 else ""
    return f"{task['dag_id']}/{task['run_id']}/{task['task_id']}{index}"


def read(task: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The DAG run and the task instance as the API server has them now (``{}``: the DAG run is gone); raises
    :class:`AirflowApiError` when they cannot be read (no API set, no answer, a refusal)."""
    api = os.environ.get(API_ENV, "").rstrip("/")
    if not api.startswith(("http://", "https://")):
        raise AirflowApiError(0, f"no Airflow API to ask ({API_ENV} is {api!r}: AirflowSettings.api_url)")
    headers = {"Authorization": f"Bearer {_token(api, timeout)}", "Accept": "application/json"}
    run = (f"{api}/api/v2/dags/{urllib.parse.quote(task['dag_id'], safe='')}/dagRuns/"
           f"{urllib.parse.quote(task['run_id'], safe='')}")
    try:
        dag_run = _call("GET", run, headers, None, timeout)
    except AirflowApiError as err:
        if err.status == 404:
            return {}
        raise
    instance = f"{run}/taskInstances/{urllib.parse.quote(task['task_id'], safe='')}"
    if task["map_index"] >= 0:
        instance += f"/{task['map_index']}"
    try:
        task_instance = _call("GET", instance, headers, None, timeout)
    except AirflowApiError as err:
        if err.status != 404:
            raise
        task_instance = {"state": "removed"}  # the run is there and the task is not: gone from the DAG
    return {"dag_run": dag_run, "task_instance": task_instance}


def run_stopped(state: dict[str, Any] | None, seen: bool = True) -> str | None:
    """How the Airflow run was stopped, from :func:`read`'s answer (``{}``: the DAG run not found); None while it
    goes on or when there is nothing to tell by. A DAG run never ``seen`` and not found now is no proof of a
    stopped run (a wrong name, a user who may not see it): None."""
    if state is None or (not state and not seen):
        return None
    if not state:
        return "is gone (its Airflow DAG run was deleted)"
    run_state = state["dag_run"].get("state")
    task_state = state["task_instance"].get("state")
    if task_state in TASK_ENDED:
        return f"was stopped (its Airflow task instance is {task_state})"
    if task_state in TASK_CLEARED:
        return f"was cleared (its Airflow task instance is {task_state or 'without a state'})"
    if run_state in RUN_ENDED:
        return f"has ended (its Airflow DAG run is {run_state})"
    return None


def _token(api: str, timeout: float) -> str:
    """A token for the API: the secret's own, else one the API server gives for the secret's user."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token
    username, password = os.environ.get(USERNAME_ENV), os.environ.get(PASSWORD_ENV)
    if not (username and password):
        raise AirflowApiError(0, f"no credentials for the Airflow API: the api_secret needs {USERNAME_ENV} and "
                                 f"{PASSWORD_ENV}, or {TOKEN_ENV}")
    answer = _call("POST", f"{api}/auth/token", {"Content-Type": "application/json"},
                   json.dumps({"username": username, "password": password}).encode(), timeout)
    if not isinstance(answer.get("access_token"), str):
        raise AirflowApiError(0, f"{api}/auth/token gave no access_token")
    return answer["access_token"]


def _call(method: str, url: str, headers: dict[str, str], body: bytes | None, timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as err:
        raise AirflowApiError(err.code, str(err.reason)) from None
    except (urllib.error.URLError, OSError) as err:  # refused, reset, timed out
        raise AirflowApiError(0, f"{type(err).__name__}: {getattr(err, 'reason', err)}") from None
    except ValueError:
        raise AirflowApiError(0, f"{url} did not answer JSON") from None
    if not isinstance(answer, dict):
        raise AirflowApiError(0, f"{url} answered {type(answer).__name__}, not an object")
    return answer
