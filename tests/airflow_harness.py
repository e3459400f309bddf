"""What the Airflow tests share (tests/test_airflow_*.py; their fixture `airflow_venv` is conftest's): an Airflow
home per test, the settings file a DAG parse reads, `airflow dags test` with a run's params, and reads of the
run's database."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-airflow"
SIDE = Path(__file__).resolve().parent / "airflow_side"
PARAMS = yaml.safe_load((REPO / "params.yaml").read_text())


def settings_file(tmp: Path, values: dict) -> Path:
    path = tmp / "airflow-settings.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def airflow_env(home: Path, settings: Path) -> dict[str, str]:
    return {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "CLOOB_AIRFLOW_SETTINGS": str(settings)}


def migrated(home: Path, settings: Path) -> Path:
    """An Airflow home with its database made (``airflow db migrate``), for ``airflow dags test``."""
    done = subprocess.run([str(VENV / "bin" / "airflow"), "db", "migrate"], env=airflow_env(home, settings),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return home


def run_params() -> dict:
    """A copy of params.yaml's parameters, to change for one run."""
    return json.loads(json.dumps(PARAMS))


def dags_test(home: Path, settings: Path, dag_id: str, params: dict | None = None) -> str:
    """``airflow dags test DAG`` (with the run's params): its log."""
    command = [str(VENV / "bin" / "airflow"), "dags", "test", dag_id]
    if params is not None:
        command += ["-c", json.dumps({"params": json.dumps(params)})]
    done = subprocess.run(command, env=airflow_env(home, settings), capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    return done.stdout + done.stderr


def states(log: str) -> list[str]:
    """The task states an ``airflow dags test`` log records, in order."""
    return [line.split("new_state=")[1].split()[0] for line in log.splitlines() if "new_state=" in line]


def query(home: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(home / "airflow.db") as db:
        return db.execute(sql).fetchall()
