"""What an Airflow task that runs a pipeline step is, in either mode (pipelines/airflow_steps.py picks the mode):
the step's inputs (templated: XCom's locations and small JSON, ``{{ params.params }}``) with a mapped task's item,
its output location (``<runs>/<DAG>/<run>/<task>[-<index>]``, the same for each try, so a retry republishes in
place), and the result it returns as its XCom, read from the record the step leaves once it has ended well
(cloob_core/ops/task_runner.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from cloob_core.config.airflow import AirflowSettings

PERMANENT_EXIT = 2  # cloob_core.ops.task_runner's (not imported: it reaches the stages' code)


def _plain(value: Any) -> Any:
    """XCom's values as JSON: a mapped task's lazy sequence of results as a list."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(item) for item in value]
    return value


class StepTask(BaseOperator):
    """A step's task in either mode: the step's inputs (templated: XCom references and ``{{ params.params }}``), with a
    mapped task's ``item`` under ``item_key`` (None: the item is a dict of inputs), and its output location."""

    template_fields: Sequence[str] = ("inputs", "item")

    def __init__(self, *, step: str, settings: str, inputs: dict[str, Any], item: Any = None,
                 item_key: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step, self.settings, self.inputs, self.item, self.item_key = step, settings, inputs, item, item_key

    def _resolved(self, context: Any) -> tuple[dict[str, Any], str]:
        inputs = _plain(dict(self.inputs))
        if self.item is not None:
            inputs.update({self.item_key: _plain(self.item)} if self.item_key else _plain(self.item))
        ti = context["ti"]
        settings = AirflowSettings.model_validate_json(self.settings)
        return inputs, settings.output_of(ti.dag_id, context["run_id"], ti.task_id, ti.map_index)


def finished_result(step: str, record: Any) -> Any:
    """The result in a step's record (cloob_core.ops.task_runner.finished); none, or another step's, fails the
    task: the step did not end well, whatever its runner reported (apache/airflow #73006)."""
    if not isinstance(record, dict) or record.get("step") != step or "result" not in record:
        raise AirflowException(f"step {step} left no record of having finished (was it stopped?): not a success")
    return record["result"]
