"""A scheduled retraining (`cloob_nightly`, mode local) that the gate does not promote leaves the production model's
Asset untouched: the promote task succeeds with NOT PROMOTED, the asset's task is skipped, no asset event is
recorded (before the asset had a task of its own, the promote task's success recorded one). And its decision reaches
the Pushgateway as a Kubeflow run's does, in the same group and series: what CloobNoPromotionDecision reads, which
fires when a scheduled run of either front fails before its gate (infra/monitoring/alerts.rules.yml)."""

from __future__ import annotations

import pytest
from airflow_harness import dags_test, migrated, query, run_params, settings_file

pytestmark = pytest.mark.airflow


@pytest.mark.slow  # the whole pipeline with 8 training steps: about 2 minutes
def test_a_not_promoted_nightly_run_leaves_the_production_asset_untouched(airflow_venv, tmp_path, pushgateway):
    settings = settings_file(tmp_path, {"runs": str(tmp_path / "runs")})
    home = migrated(tmp_path / "home", settings)
    params = run_params()
    params["train"].update(steps=8, log_every=4, checkpoint_every=4)  # a short run
    params["promote"]["min_first"] = {"suite.retrieval_recall@5": 0.9}  # the first model's floor, out of its reach
    address, pushed = pushgateway
    params["promote"]["pushgateway"] = address
    log = dags_test(home, settings, "cloob_nightly", params)
    assert "DagRun Finished" in log and "state=success" in log.split("DagRun Finished")[-1], log[-3000:]
    assert "not promoted" in log.lower(), log[-3000:]
    assert query(home, "select count(*) from asset_event")[0][0] == 0, "a NOT PROMOTED run recorded an asset event"
    assert query(home, "select state from task_instance where dag_id='cloob_nightly' and "
                 "task_id='production_moved'") == [("skipped",)]
    decisions = [body for path, body in pushed if path.startswith("/metrics/job/cloob-promote/store")]
    assert len(decisions) == 1 and "cloob_promotion_promoted 0.0" in decisions[0], pushed
    assert "cloob_promotion_decision_timestamp_seconds" in decisions[0]
