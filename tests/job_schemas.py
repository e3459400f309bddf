"""The training-job APIs' strict schemas (infra/training/crd_schemas.yaml) as validators, and the pruning an API
server applies to a structural CRD's objects: every field its schema does not name is dropped without a word."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

SCHEMAS = Path(__file__).resolve().parents[1] / "infra" / "training" / "crd_schemas.yaml"


@functools.cache
def _schemas() -> dict[str, Any]:
    return yaml.safe_load(SCHEMAS.read_text())


def schema_name(kind: str, release: str = "v2.3") -> str:
    """The schema of a job kind of cloob_core.ops.trainjob.KINDS, for a Trainer release where it has one."""
    return "PyTorchJob" if kind == "pytorchjob" else f"TrainJob/{release}"


def validator(name: str) -> Any:
    import jsonschema

    schemas = dict(_schemas())
    return jsonschema.Draft7Validator({**schemas[name], "definitions": schemas["definitions"]})


def errors(name: str, body: dict) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in
            validator(name).iter_errors(body)]


def pruned(name: str, body: Any) -> Any:
    """``body`` as an API server whose CRD has schema ``name`` stores it."""
    return _prune(body, _schemas()[name])


def _resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = _schemas()["definitions"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _prune(value: Any, schema: dict) -> Any:
    schema = _resolve(schema)
    if isinstance(value, dict):
        known = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        kept = {}
        for key, item in value.items():
            if known is not None and key in known:
                kept[key] = _prune(item, known[key])
            elif isinstance(extra, dict):
                kept[key] = _prune(item, extra)
            elif extra is not False:
                kept[key] = item
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(item, schema["items"]) for item in value]
    return value
