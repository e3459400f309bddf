"""Submission and schedules through the KFP API (kfp.Client): a one-off run, and recurring runs for scheduled
retraining or re-evaluation (one at a time, no catch-up after downtime). The run parameter is the whole
configuration, validated here first so that a bad key fails on the laptop, not in the cluster."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cloob_core.config import load_config


def run_parameters(params_file: str | None, overrides: Sequence[str] = ()) -> dict[str, str]:
    """``{"params": <the configuration as JSON>}`` after the same validation every `cloob` command applies."""
    config = load_config(params_file, list(overrides))
    return {"params": json.dumps(config.model_dump())}


def connect(host: str, namespace: str | None = None) -> Any:
    """A client for ``host``; a bearer token, where the cluster needs one, comes from ``KFP_TOKEN``."""
    import kfp

    return kfp.Client(host=host, namespace=namespace, existing_token=os.environ.get("KFP_TOKEN") or None)


def experiment_id(client: Any, name: str, namespace: str | None = None) -> str:
    """The experiment's id, creating it on first use."""
    return client.create_experiment(name, namespace=namespace).experiment_id


@dataclass(frozen=True)
class Submitted:
    run_id: str
    experiment_id: str


def submit(client: Any, package: str, experiment: str, run_name: str, parameters: dict[str, str],
           namespace: str | None = None, enable_caching: bool | None = None) -> Submitted:
    result = client.create_run_from_pipeline_package(package, arguments=parameters, run_name=run_name,
                                                     experiment_name=experiment, namespace=namespace,
                                                     enable_caching=enable_caching)
    return Submitted(result.run_id, experiment_id(client, experiment, namespace))


def schedule(client: Any, package: str, experiment: str, name: str, cron: str, parameters: dict[str, str],
             namespace: str | None = None, enabled: bool = True) -> str:
    """A recurring run on a cron schedule (KFP's six fields, seconds first: ``0 0 3 * * *`` is 03:00 daily),
    at most one run at a time and no backfill of the times missed while paused or down."""
    recurring = client.create_recurring_run(
        experiment_id=experiment_id(client, experiment, namespace), job_name=name, cron_expression=cron,
        max_concurrency=1, no_catchup=True, pipeline_package_path=package, params=parameters, enabled=enabled)
    return recurring.recurring_run_id


def list_schedules(client: Any, experiment: str, namespace: str | None = None) -> list[dict[str, Any]]:
    listed = client.list_recurring_runs(experiment_id=experiment_id(client, experiment, namespace), page_size=100)
    return [{"id": r.recurring_run_id, "name": r.display_name, "status": str(r.status),
             "cron": getattr(getattr(getattr(r, "trigger", None), "cron_schedule", None), "cron", None)}
            for r in listed.recurring_runs or []]


def delete_schedule(client: Any, recurring_run_id: str) -> None:
    client.delete_recurring_run(recurring_run_id)
