"""The Airflow tasks that run the pipeline's steps: each one ``python -m cloob_core.ops.task_runner STEP`` on the
step's inputs, publishing its files at ``<runs>/<DAG>/<run>/<task>[-<index>]`` and returning the step's JSON result
as its XCom (pipelines/airflow_task.py). ``local``: a process of the project's venv on the worker
(pipelines/airflow_local.py); ``kubernetes``: the step's pod, the one the Kubeflow pipeline gives it
(pipelines/airflow_pods.py). Every step's retries, backoff and execution timeout are its pod description's
(:func:`cloob_core.ops.pods.pod`). No stage logic here: the step's body is the Kubeflow component's."""

from __future__ import annotations

import datetime as dt
from typing import Any

from cloob_core.config.airflow import AirflowSettings
from cloob_core.ops import pods
from pipelines.airflow_task import StepTask


class _Factory:
    """Makes a step's task (or, with :meth:`partial`, its mapped task) with the step's retries and timeout."""

    def __init__(self, operator: type[StepTask], **fixed: Any) -> None:
        self.operator, self.fixed = operator, fixed

    def __call__(self, **kwargs: Any) -> StepTask:
        return self.operator(**self.fixed, **kwargs)

    def partial(self, **kwargs: Any) -> Any:
        return self.operator.partial(**self.fixed, **kwargs)


def step_operator(step: str, settings: AirflowSettings, **kwargs: Any) -> _Factory:
    """The task factory of ``step`` for ``settings``: its retries and backoff are the pod description's, its
    execution timeout the pod's deadline or ``step_timeout_s``; in mode kubernetes, the pod itself."""
    pod = pods.pod(step, settings.cluster)
    retry = pod.retry or pods.Retry(0, 0, 0)
    timeout = pod.timeout_s or settings.step_timeout_s
    fixed = {"task_id": step, "step": step, "settings": settings.model_dump_json(), "retries": retry.count,
             "retry_delay": dt.timedelta(seconds=retry.backoff_s), "retry_exponential_backoff": retry.factor,
             "max_retry_delay": dt.timedelta(seconds=pods.MAX_BACKOFF_S),
             "execution_timeout": dt.timedelta(seconds=timeout), **kwargs}
    if settings.mode == "kubernetes":  # the provider's pod operator, imported only where pods are made
        from pipelines.airflow_pods import PodStep, pod_arguments

        return _Factory(PodStep, **fixed, **pod_arguments(step, settings))
    from pipelines.airflow_local import LocalStep

    return _Factory(LocalStep, **fixed)
