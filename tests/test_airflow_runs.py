"""Whole local runs of the Airflow DAGs (`airflow dags test`, mode local, each task a step of the project's venv):
`scripts/airflow.sh` on the packaged default ends with its suite table, with every figure equal to `dvc repro`'s on
the same parameters, and moves the production asset. (A NOT PROMOTED nightly: tests/test_airflow_nightly.py.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from airflow_harness import REPO, airflow_env, query, run_params, settings_file
from test_dvc_pipeline import copy_repository, environment, short_training

from cloob_core.config.airflow import AirflowSettings

pytestmark = pytest.mark.airflow


@pytest.fixture(scope="module")
def promoted(airflow_venv, tmp_path_factory) -> dict:
    """scripts/airflow.sh in its own Airflow home and runs folder, a whole local run of cloob_pretrain that promotes
    (its registry has no production model yet), and beside it `dvc repro` in a copy of the repository on the same
    parameters and seed. Both on one thread per step: a step's figures depend on the cores it plans its threads
    for (the order of a sum), as `dvc repro`'s do; they run at once on two cores."""
    tmp = tmp_path_factory.mktemp("airflow")
    settings = settings_file(tmp, {"runs": str(tmp / "runs")})
    threads = {"LOKY_MAX_CPU_COUNT": "1"}
    repository = copy_repository(tmp / "repo")
    (repository / "params.yaml").write_text(yaml.safe_dump(short_training(run_params()), sort_keys=False))
    dvc = subprocess.Popen(["dvc", "repro"], cwd=repository, env={**environment(), **threads}, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    params = short_training(run_params())
    params["promote"]["store"] = str(tmp / "runs" / "registry")
    done = subprocess.run([str(REPO / "scripts" / "airflow.sh"), "-c", json.dumps({"params": json.dumps(params)})],
                          env={**airflow_env(tmp / "home", settings), **threads}, capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    repro_log, _ = dvc.communicate(timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert dvc.returncode == 0, repro_log[-4000:]
    run_id = done.stdout.split("airflow: run ", 1)[1].split()[0]
    report = AirflowSettings(runs=str(tmp / "runs")).located(REPO).output_of("cloob_pretrain", run_id, "report")
    return {"home": tmp / "home", "output": done.stdout,
            "metrics": json.loads((Path(report) / "metrics.json").read_text()),
            "dvc_metrics": json.loads((repository / "reports" / "metrics.json").read_text())}


def _asset_events(home) -> int:
    return query(home, "select count(*) from asset_event")[0][0]


@pytest.mark.slow  # the whole pipeline, beside dvc repro: about 4 minutes
def test_a_local_run_gives_the_figures_of_dvc_repro_to_the_digit_and_moves_the_production_asset(promoted):
    output = promoted["output"]
    print(output[-1500:])
    assert "suite means over 4 data sets" in output  # the run's suite table, as ./scripts/pipeline.sh ends
    suite, dvc_suite = promoted["metrics"]["suite"], promoted["dvc_metrics"]["suite"]
    assert set(suite) == set(dvc_suite) == {"linear_probe_acc1", "retrieval_recall@1", "retrieval_recall@5",
                                            "zeroshot_acc1"}
    assert suite == dvc_suite  # every figure, to the last digit
    assert {name: value for name, value in promoted["metrics"].items() if name != "suite"} == \
        {name: value for name, value in promoted["dvc_metrics"].items() if name != "suite"}
    assert _asset_events(promoted["home"]) == 1  # the first model, promoted: production moved
