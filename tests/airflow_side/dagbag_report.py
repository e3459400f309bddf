"""Run in Airflow's venv (.venv-airflow): the DAG folder parsed by Airflow's DagBag, reported as JSON into the file
argv[2] (Airflow logs to stdout): import errors, the modules the parse imported, and each DAG's conventions and tasks
(upstream, mapped, retries, timeouts, outlets)."""

import json
import sys
from pathlib import Path

from airflow.dag_processing.dagbag import DagBag

bag = DagBag(str(Path(sys.argv[1])))
report = {"errors": {str(k): v.strip().splitlines()[-1] for k, v in bag.import_errors.items()},
          "imported": sorted(name for name in sys.modules
                             if name.split(".")[0] in {"torch", "kfp", "open_clip", "numpy", "duckdb", "boto3", "PIL",
                                                       "webdataset", "pyarrow"}
                             or name in {"cloob_core.ops.kubeflow", "cloob_core.ops.task_runner"}),
          "dags": {}}
for dag_id, dag in bag.dags.items():
    tasks = {}
    for task in dag.tasks:
        timeout = task.execution_timeout
        tasks[task.task_id] = {
            "upstream": sorted(task.upstream_task_ids), "mapped": type(task).__name__ == "MappedOperator",
            "retries": task.retries, "retry_delay_s": task.retry_delay.total_seconds(),
            "backoff": task.retry_exponential_backoff, "timeout_s": timeout.total_seconds() if timeout else None,
            "outlets": [getattr(asset, "uri", str(asset)) for asset in task.outlets]}
    timeout = dag.dagrun_timeout
    report["dags"][dag_id] = {
        "schedule": dag.schedule if isinstance(dag.schedule, str) else None,
        "catchup": dag.catchup, "max_active_runs": dag.max_active_runs,
        "dagrun_timeout_s": timeout.total_seconds() if timeout else None,
        "params": sorted(dag.params.keys()), "tasks": tasks}
Path(sys.argv[2]).write_text(json.dumps(report))
