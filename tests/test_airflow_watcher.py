"""The multi-node watcher under Airflow (ops/airflow_run.py) against Airflow's own API server (3.x, on loopback, its
SQLite database, the simple auth manager): what a person does in Airflow's UI, done through the same REST API
(mark the task failed, clear it, mark the run failed), is what the watcher reads after its SIGTERM, and only then
is the job deleted; a SIGTERM while the run goes on (a worker's restart) leaves it to the next try. The training
job lives on the stand-in Kubernetes API server (tests/k8s_api_server.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.request

import pytest
from airflow_harness import VENV, airflow_env, migrated, settings_file
from k8s_api_server import FakeTrainingCluster
from test_trainjob import _sigterm_once, _stub_python, job_config, settings, under_airflow

from cloob_core.ops import trainjob
from cloob_core.ops.trainjob import JobFailed

pytestmark = pytest.mark.airflow

USER, PASSWORD = "watcher", "not-a-real-password"  # the watcher's: a viewer, who may only read
PERSON = ("person", "another-password")  # the one who acts in the UI: an admin
TASK = "train_multinode"


class _Airflow:
    """Airflow's API server and its database: the runs it holds and what a person does to them."""

    def __init__(self, url: str, home) -> None:
        self.url, self.home = url, home

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        token = self._request("POST", "/auth/token", {"username": PERSON[0], "password": PERSON[1]}, None)
        return self._request(method, path, body, token["access_token"])

    def _request(self, method: str, path: str, body: dict | None, token: str | None) -> dict:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode() if body else None,
                                         headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            return json.loads(answer.read())

    def running(self, run_id: str) -> None:
        """A run of cloob_pretrain whose multi-node training task runs, as the scheduler and a worker leave it."""
        self.call("POST", "/api/v2/dags/cloob_pretrain/dagRuns", {"dag_run_id": run_id, "logical_date": None})
        with sqlite3.connect(self.home / "airflow.db") as db:
            db.execute("UPDATE dag_run SET state = 'running' WHERE run_id = ?", (run_id,))
            db.execute("UPDATE task_instance SET state = 'running', try_number = 1 WHERE run_id = ? AND task_id = ?",
                       (run_id, TASK))

    def task_state(self, run_id: str) -> str | None:
        return self.call("GET", f"/api/v2/dags/cloob_pretrain/dagRuns/{run_id}/taskInstances/{TASK}")["state"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def airflow(airflow_venv, tmp_path_factory):
    """Airflow's API server on loopback with the DAGs in kubernetes mode, two training nodes."""
    tmp = tmp_path_factory.mktemp("airflow-api")
    values = {"mode": "kubernetes", "runs": "s3://b/airflow", "api_url": "http://airflow-api:8080",
              "api_secret": "airflow-api",
              "cluster": {"nodes": 2, "gpus": 8, "shards_store": "s3://b/shards", "job_workdir": "s3://b/jobs"}}
    settings_path = settings_file(tmp, values)
    home = migrated(tmp / "home", settings_path)
    (tmp / "passwords.json").write_text(json.dumps({USER: PASSWORD, PERSON[0]: PERSON[1]}))
    env = {**airflow_env(home, settings_path),
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:viewer,{PERSON[0]}:admin",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(tmp / "passwords.json")}
    reserialized = subprocess.Popen([str(VENV / "bin" / "airflow"), "dags", "reserialize"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port = _free_port()
    log = (tmp / "api-server.log").open("w")
    server = subprocess.Popen([str(VENV / "bin" / "airflow"), "api-server", "--host", "127.0.0.1", "--port",
                               str(port), "--workers", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert reserialized.wait(timeout=300) == 0
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, \
                    (tmp / "api-server.log").read_text()[-3000:]
                time.sleep(0.5)
        yield _Airflow(url, home)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()


ACTIONS = {
    # a worker's restart (or a scheduler fail-over, an eviction): the pod goes, the run and the task go on
    "worker restart": (lambda airflow, run: None, None),
    "task marked failed": (lambda airflow, run: airflow.call(
        "PATCH", f"/api/v2/dags/cloob_pretrain/dagRuns/{run}/taskInstances/{TASK}", {"new_state": "failed"}),
        "failed"),
    "task cleared": (lambda airflow, run: airflow.call(
        "POST", "/api/v2/dags/cloob_pretrain/clearTaskInstances",
        {"dry_run": False, "dag_run_id": run, "task_ids": [TASK], "only_failed": False}), "restarting"),
    "run marked failed": (lambda airflow, run: airflow.call(
        "PATCH", f"/api/v2/dags/cloob_pretrain/dagRuns/{run}", {"state": "failed"}), "failed"),
}


@pytest.mark.parametrize("action", ACTIONS)
def test_the_watcher_deletes_the_job_when_a_person_stopped_the_airflow_run_and_keeps_it_otherwise(
        airflow, tmp_path, monkeypatch, action):
    act, task_state = ACTIONS[action]
    run_id = f"manual__{action.replace(' ', '-')}"
    airflow.running(run_id)
    with FakeTrainingCluster(extra_env=_stub_python(tmp_path / "bin", "sleep 5\nexit 0\n")) as cluster:
        under_airflow(tmp_path, monkeypatch, cluster, airflow.url, run_id, (USER, PASSWORD))
        job = settings(nodes=2, gpus=0, job_poll_s=0.05, job_namespace="team-a", s3_secret="")
        body = trainjob.manifest(job, "cloob-train-airflow", job_config(), "s3://w")
        _sigterm_once(cluster, ("team-a", "pytorchjobs", "cloob-train-airflow"),
                      lambda: act(airflow, run_id)).join(timeout=0)
        with pytest.raises(JobFailed) as raised:
            trainjob.run(body, job)
        assert airflow.task_state(run_id) == (task_state or "running")  # what Airflow's own code recorded
        deletes = cluster.calls("DELETE", ".*pytorchjobs/cloob-train-airflow")
        if task_state is None:
            assert "left running, and the step's next try adopts it" in str(raised.value) and not deletes
            assert trainjob.run(body, job).startswith("Succeeded")  # the task's next try adopts the job
        else:
            assert f"cancelled: the pipeline run was {'cleared' if action == 'task cleared' else 'stopped'}" in \
                str(raised.value) and len(deletes) == 1
