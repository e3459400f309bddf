"""The Airflow front's DAGs (pipelines/airflow_dags.py, dags/cloob.py) as Airflow's DagBag parses them in its own
venv: the three DAGs import without torch and keep the scheduling conventions; their steps, order and fan-outs are
the declaration's (the Kubeflow pipeline is checked against the same declaration: tests/test_pipeline_graph.py),
each task's retries and timeout its pod description's; a wrong setting is one line; a user's error fails its task
without a retry. The runs: tests/test_airflow_runs.py, tests/test_airflow_retry.py. CI runs them in their own phase
(.ci/run), after `scripts/airflow.sh --setup`."""

from __future__ import annotations

import json
import subprocess

import pytest
from airflow_harness import REPO, SIDE, VENV, airflow_env, dags_test, migrated, run_params, settings_file, states
from graphs import reduced

from cloob_core.config.airflow import AirflowSettings
from cloob_core.ops import graph, pods

pytestmark = pytest.mark.airflow


def _dagbag(tmp, values: dict) -> dict:
    out = tmp / "dagbag.json"
    done = subprocess.run([str(VENV / "bin" / "python"), str(SIDE / "dagbag_report.py"), str(REPO / "dags"), str(out)],
                          env=airflow_env(tmp / "home", settings_file(tmp, values)), capture_output=True, text=True,
                          timeout=300, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


CASES = {
    "local, the packaged default": {},
    "local, curation": {"cluster": {"curation": True}},
    "local, shards imported": {"cluster": {"data": "import"}},
}


@pytest.mark.parametrize("case", CASES)
def test_the_dags_parse_without_torch_and_are_the_declared_graph(airflow_venv, tmp_path, case):
    values = CASES[case]
    report = _dagbag(tmp_path, values)
    assert report["errors"] == {}
    assert report["imported"] == []  # no torch, kfp, numpy or stage at parse time
    settings = AirflowSettings(**values).located(REPO)
    dags = report["dags"]
    assert set(dags) == {"cloob_pretrain", "cloob_nightly", "cloob_evaluate"}
    for dag_id, dag in dags.items():
        assert dag["catchup"] is False and dag["max_active_runs"] == 1, dag_id
        declared = graph.graph("evaluate" if dag_id == "cloob_evaluate" else "pretrain", settings.cluster)
        tasks = dag["tasks"]
        # the Airflow-only tasks: the task lists flattened between features and tasks; the asset after promotion
        flattened = tasks.pop("suite_tasks")
        assert flattened["upstream"] == ["prepare_features"]
        moved = tasks.pop("production_moved", None)
        if dag_id != "cloob_evaluate":
            assert moved["upstream"] == ["promote"] and moved["outlets"][0].endswith("/production.json")
        before = {name: {"prepare_features" if up == "suite_tasks" else up for up in task["upstream"]}
                  for name, task in tasks.items()}
        assert reduced(before) == {step.name: set(step.after) for step in declared}, dag_id
        assert {name: task["mapped"] for name, task in tasks.items()} == \
            {step.name: step.maps_over is not None for step in declared}
        for step in declared:
            pod, task = pods.pod(step.name, settings.cluster), tasks[step.name]
            retry = pod.retry or pods.Retry(0, 0, 0)
            assert (task["retries"], task["retry_delay_s"], task["backoff"]) == \
                (retry.count, retry.backoff_s, retry.factor), step.name
            assert task["timeout_s"] == (pod.timeout_s or settings.step_timeout_s), step.name
    assert dags["cloob_pretrain"]["schedule"] is None
    assert dags["cloob_nightly"]["schedule"] == settings.nightly_schedule
    assert dags["cloob_nightly"]["dagrun_timeout_s"] == settings.nightly_timeout_s < 24 * 3600
    assert ("shards_uri" in dags["cloob_pretrain"]["params"]) == (settings.cluster.data == "import")


def test_a_nightly_timeout_past_its_period_is_refused_in_one_line(airflow_venv, tmp_path):
    report = _dagbag(tmp_path, {"nightly_schedule": "0 */6 * * *", "nightly_timeout_s": 7 * 3600})
    (error,) = report["errors"].values()
    assert "nightly_timeout_s (25200) must be shorter than nightly_schedule's period (21600 s)" in error
    assert report["dags"] == {}


@pytest.mark.slow  # a DAG run up to its first task's failure: about a minute
def test_a_users_error_fails_its_task_at_once_without_a_retry(airflow_venv, tmp_path):
    settings = settings_file(tmp_path, {"runs": str(tmp_path / "runs")})
    home = migrated(tmp_path / "home", settings)
    params = run_params()
    params["acquire"]["source"] = str(tmp_path / "no-such-manifest.parquet")
    log = dags_test(home, settings, "cloob_pretrain", params)
    acquire = [line for line in log.splitlines() if "no-such-manifest" in line]
    assert acquire, log[-3000:]
    assert "up_for_retry" not in states(log)  # acquire has two retries for transient failures: none used
    assert "failed" in states(log)
    assert "AirflowFailException" in log  # failed for good, not for a retry
