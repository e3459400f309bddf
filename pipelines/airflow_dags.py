"""The Airflow front: the pipelines' graphs (:mod:`cloob_core.ops.graph`) rendered as Airflow 3 DAGs, each step a
task that runs ``python -m cloob_core.ops.task_runner STEP`` (:mod:`pipelines.airflow_steps`), locally or as the
step's pod. ``cloob_pretrain`` (by hand) and ``cloob_nightly`` (a cron) train, evaluate and promote; the
production model is an Asset that only a promotion updates; ``cloob_evaluate`` re-evaluates production and records
its metrics.

A fan-out is a mapped task (the KFP pipeline's ParallelFor); a fan-out inside a fan-out (data set x task) goes
through one small task that flattens the data sets' task lists (``suite_tasks``: Airflow maps over one list); XCom
carries locations and small JSON, never data. Parsed by Airflow's scheduler in Airflow's venv: imports Airflow,
the settings, the graph and the pods' declarations, never torch or a stage."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Asset, Param, task
from airflow.sdk.exceptions import AirflowSkipException

from cloob_core.config.airflow import AirflowSettings
from cloob_core.config.base import ConfigError
from cloob_core.config.cluster import MAX_DOWNLOAD_GROUPS
from cloob_core.ops import graph
from pipelines.airflow_steps import step_operator
from pipelines.params import DEFAULT_PARAMS

REPO = Path(__file__).resolve().parents[1]
PARAMS = "{{ params.params }}"  # the run's parameters: the DAG's param, as KFP's run parameter
SHARDS_URI = "{{ params.shards_uri }}"  # with data: import, the shards trained on (KFP's shards_uri parameter)
# Tasks of the Airflow DAGs that are not pipeline steps: the data sets' task lists flattened (between the features
# and the tasks), and the production asset's update (after the promotion).
SUITE_TASKS = "suite_tasks"
PRODUCTION_MOVED = "production_moved"
AIRFLOW_ONLY = {SUITE_TASKS: ("prepare_features", "evaluate"), PRODUCTION_MOVED: ("promote", None)}
# the steps whose results' keys later steps read (each key its own XCom: Airflow's multiple_outputs)
KEYED = {"acquire", "merge_shards", "curate", "validate_shards", "train", "train_multinode", "production_model",
         "report"}
START = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def production_asset(settings: AirflowSettings, params: str = DEFAULT_PARAMS) -> Asset:
    """The production model of the default parameters' ``promote.store``, as an Asset (its pointer file)."""
    import json

    store = json.loads(params)["promote"]["store"]
    uri = store if "://" in store else Path(store).resolve().as_uri()
    return Asset(name="cloob-production-model", uri=f"{uri.rstrip('/')}/production.json")


def _default_params(settings: AirflowSettings) -> str:
    """params.yaml; a local run promotes into its own registry under ``runs``, never the DVC pipeline's."""
    import json

    params = json.loads(DEFAULT_PARAMS)
    if settings.mode == "local":
        params["promote"]["store"] = f"{settings.runs}/registry"
    return json.dumps(params)


def _period_s(cron: str) -> float:
    """The shortest gap between two fire times of ``cron`` over the next year."""
    from croniter import croniter

    times = croniter(cron, START)
    previous, shortest = times.get_next(float), float("inf")
    for _ in range(400):
        current = times.get_next(float)
        shortest, previous = min(shortest, current - previous), current
    return shortest


def _render(dag: DAG, steps: list[graph.Step], settings: AirflowSettings, production: Asset) -> None:
    """The steps of one pipeline as tasks of ``dag``, wired as the KFP pipeline wires them."""
    cluster = settings.cluster
    made: dict[str, Any] = {}

    def out(name: str, key: str | None = None) -> Any:
        return made[name].output if key is None else made[name].output[key]

    def shards() -> Any:
        """The shards the next step reads: the merged, curated or checked folder."""
        for name, key in (("validate_shards", "shards"), ("curate", "curated"), ("merge_shards", "shards")):
            if name in made:
                return out(name, key)
        return SHARDS_URI  # data: import (no step gives them)

    def model() -> Any:
        for name in ("train", "train_multinode", "production_model"):
            if name in made:
                return out(name, "model")
        raise ConfigError("no step gives the model")

    most = min(cluster.partitions, MAX_DOWNLOAD_GROUPS)
    inputs: dict[str, Callable[[], dict[str, Any]]] = {
        "acquire": lambda: {"params": PARAMS, "store": cluster.shards_store},
        "validate_manifest": lambda: {"params": PARAMS, "manifest": out("acquire", "manifest")},
        "plan_download": lambda: {"params": PARAMS, "manifest": out("acquire", "manifest"), "most": most},
        "download_partition": lambda: {"params": PARAMS, "manifest": out("acquire", "manifest"),
                                       "shards": out("acquire", "shards")},
        "merge_shards": lambda: {"shards": out("acquire", "shards"), "parts": out("download_partition")},
        "plan_scoring": lambda: {"params": PARAMS, "shards": shards(), "most": most},
        "score_partition": lambda: {"params": PARAMS, "shards": shards()},
        "curate": lambda: {"params": PARAMS, "shards": shards(), "parts": out("score_partition")},
        "validate_shards": lambda: {"params": PARAMS, "shards": shards()},
        "train": lambda: {"params": PARAMS, "shards": shards(), "gpus": cluster.gpus, "workdir": cluster.job_workdir,
                          "run_id": "{{ run_id }}", "keep_checkpoints": cluster.keep_checkpoints},
        "train_multinode": lambda: {"params": PARAMS, "shards": shards(), "job": cluster.to_json(),
                                    "run_id": "{{ run_id }}"},
        "end_training_job": lambda: {"job": cluster.to_json(), "run_id": "{{ run_id }}"},
        "plan_evaluation": lambda: {"params": PARAMS},
        "prepare_features": lambda: {"params": PARAMS, "model": model()},
        "evaluate": lambda: {"params": PARAMS, "model": model()},
        "collect_dataset": lambda: {"parts": out("evaluate")},
        "report": lambda: {"params": PARAMS, "model": model(), "datasets": out("collect_dataset")},
        "promote": lambda: {"params": PARAMS, "model": model(), "report": out("report", "folder")},
        "production_model": lambda: {"params": PARAMS},
        "record_production_metrics": lambda: {"params": PARAMS, "report": out("report", "folder")},
    }
    # the input a mapped step's item fills: the partition, the data set, or (None) the whole item, a dict
    item_key = {"download_partition": "partition", "score_partition": "partition", "prepare_features": "dataset",
                "collect_dataset": "dataset", "evaluate": None}
    for step in steps:
        if step.maps_over == "prepare_features":  # a fan-out over a fan-out's lists: flattened first
            made[SUITE_TASKS] = _suite_tasks(made["prepare_features"].output).operator
        operator = step_operator(step.name, settings, dag=dag, multiple_outputs=step.name in KEYED)
        if step.maps_over is None:
            made[step.name] = operator(inputs=inputs[step.name]())
        else:
            source = SUITE_TASKS if step.maps_over == "prepare_features" else step.maps_over
            made[step.name] = operator.partial(inputs=inputs[step.name](), item_key=item_key[step.name]
                                               ).expand(item=made[source].output)
        for before in step.after:
            made[before] >> made[step.name]
        if step.maps_over == "prepare_features":
            made[SUITE_TASKS] >> made[step.name]
    for step in steps:
        if step.at_end:  # after everything, however it ended (a teardown of the run's first step)
            ended = made[step.name]
            ended.as_teardown(setups=made[steps[0].name])
            for other in steps:
                if other.name != step.name and not made[other.name].downstream_list:
                    made[other.name] >> ended
    if "promote" in made:
        made[PRODUCTION_MOVED] = _production_moved(production, made["promote"].output).operator


@task(task_id=SUITE_TASKS)
def _suite_tasks(features: Any) -> list[dict[str, Any]]:
    """Each data set's tasks, one list: the items of the tasks' fan-out."""
    return [item for per_dataset in features for item in per_dataset]


def _production_moved(production: Asset, decision: Any) -> Any:
    @task(task_id=PRODUCTION_MOVED, outlets=[production])
    def production_moved(decision: dict[str, Any]) -> str:
        """The production asset's event, only when the gate promoted: a NOT PROMOTED run leaves it untouched."""
        if not decision.get("promoted"):
            raise AirflowSkipException(f"not promoted: {decision.get('reason', 'no reason recorded')}")
        return str(decision.get("model_id", ""))

    return production_moved(decision)


def dags(settings: AirflowSettings | None = None) -> dict[str, DAG]:
    """The three DAGs for ``settings`` (default: from ``CLOOB_AIRFLOW_SETTINGS``), by id."""
    settings = (settings or AirflowSettings.load()).located(REPO)
    if settings.nightly_timeout_s >= (period := _period_s(settings.nightly_schedule)):
        raise ConfigError(f"Airflow settings: nightly_timeout_s ({settings.nightly_timeout_s:.0f}) must be shorter "
                          f"than nightly_schedule's period ({period:.0f} s): a run would still hold the model "
                          "when the next is due")
    params = _default_params(settings)
    production = production_asset(settings, params)
    common: dict[str, Any] = {"start_date": START, "catchup": False, "max_active_runs": 1, "tags": ["cloob"]}
    run_params = {"params": Param(params, type="string", description="the run's parameters (params.yaml's tree, "
                                  "as JSON or YAML)")}
    imported = {"shards_uri": Param(settings.shards_uri, type="string", description="the shards to train on (a "
                                    "folder or an s3:// prefix)")} if settings.cluster.data == "import" else {}
    made: dict[str, DAG] = {}
    for dag_id, pipeline, extra in (
            ("cloob_pretrain", "pretrain", {"schedule": None,
                                            "description": "CLOOB pretraining, evaluation and promotion."}),
            ("cloob_nightly", "pretrain", {"schedule": settings.nightly_schedule,
                                           "dagrun_timeout": dt.timedelta(seconds=settings.nightly_timeout_s),
                                           "description": "Scheduled CLOOB retraining; promotes only a better "
                                                          "model."}),
            ("cloob_evaluate", "evaluate", {"schedule": settings.evaluate_schedule,
                                            "description": "The production model re-evaluated on the suite, its "
                                                           "metrics recorded."})):
        with DAG(dag_id, params={**run_params, **(imported if pipeline == "pretrain" else {})}, **common,
                 **extra) as dag:
            _render(dag, graph.graph(pipeline, settings.cluster), settings, production)
        made[dag_id] = dag
    return made
