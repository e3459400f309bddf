"""What a compiled pipeline hands each step: KFP v2's launcher copies every input artifact of a step into its pod
before the step starts (used or not), and passes parameters, such as the shards' location, as values. Printed by
`python -m pipelines inputs`; the tests check that no large data is among the copies."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StepInputs:
    step: str
    copied: tuple[str, ...]  # input artifacts, as NAME (schema title)
    by_value: tuple[str, ...]  # input parameters


def step_inputs(spec: dict[str, Any]) -> list[StepInputs]:
    """Each step component of a compiled pipeline spec (its first YAML document), by name."""
    steps = []
    for name, component in sorted(spec["components"].items()):
        if "executorLabel" not in component:  # a loop body or other sub-DAG, not a step
            continue
        inputs = component.get("inputDefinitions", {})
        copied = tuple(f"{key} ({value['artifactType']['schemaTitle']})"
                       for key, value in sorted(inputs.get("artifacts", {}).items()))
        steps.append(StepInputs(name.removeprefix("comp-"), copied, tuple(sorted(inputs.get("parameters", {})))))
    return steps


def read_spec(package: str | Path) -> dict[str, Any]:
    import yaml

    return next(yaml.safe_load_all(Path(package).read_text("utf-8")))


def table(steps: list[StepInputs]) -> str:
    rows = [("step", "copied into the pod", "passed by value")]
    rows += [(s.step, ", ".join(s.copied) or "-", ", ".join(s.by_value) or "-") for s in steps]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in rows)
