"""The training-job CRDs as their operators ship them (tests/crds: the structural openAPIV3Schema of each release's
CRD, descriptions left out), and what an API server does with a body under them: the unknown fields that strict
field validation refuses and that pruning drops without a word (apiextensions-apiserver's structural pruning:
properties, additionalProperties, items, x-kubernetes-preserve-unknown-fields, embedded resources), and the
schema's value checks (types, enums, required fields, bounds, patterns; not its CEL rules)."""

from __future__ import annotations

import copy
import functools
import gzip
import json
from pathlib import Path
from typing import Any

CRDS = Path(__file__).resolve().parent / "crds"
# each job kind's CRD per operator release this project supports (ClusterSettings.trainer_release for a TrainJob)
RELEASES = {"pytorchjob": ("v1.8.1", "v1.9.3"), "trainjob": ("v2.1.0", "v2.2.1", "v2.3.0")}
# the fields of ObjectMeta a client may send (apimachinery's ObjectMeta); the server checks a root's metadata itself
OBJECT_META = {"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
               "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
               "ownerReferences", "finalizers", "managedFields"}


def crd_release(kind: str, trainer_release: str = "v2.3") -> str:
    """The CRD file's release for a job kind and, for a TrainJob, ClusterSettings.trainer_release."""
    if kind == "pytorchjob":
        return RELEASES["pytorchjob"][-1]
    return next(release for release in RELEASES["trainjob"] if release.startswith(f"{trainer_release}."))


@functools.cache
def crd(kind: str, release: str) -> dict[str, Any]:
    """``{"group", "version", "kind", "plural", "openAPIV3Schema", "source"}`` of one release's CRD."""
    return json.loads(gzip.decompress((CRDS / f"{kind}-{release}.json.gz").read_bytes()))


def unknown_fields(kind: str, release: str, body: dict[str, Any]) -> list[str]:
    """The paths of ``body`` that the CRD's schema does not have, as the API server names them
    (``spec.trainer.foo``, ``spec.items[0].bar``): strict field validation refuses the body for them."""
    found: list[str] = []
    _prune(copy.deepcopy(body), crd(kind, release)["openAPIV3Schema"], "", found, root=True)
    return found


def pruned(kind: str, release: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as an API server with this CRD stores it: its unknown fields dropped."""
    kept = copy.deepcopy(body)
    _prune(kept, crd(kind, release)["openAPIV3Schema"], "", [], root=True)
    return kept


def errors(kind: str, release: str, body: dict[str, Any]) -> list[str]:
    """What the API server refuses in ``body`` under strict field validation: its unknown fields, then the value
    errors of what is left."""
    import jsonschema

    unknown = [f"unknown field {path!r}" for path in unknown_fields(kind, release, body)]
    schema = crd(kind, release)["openAPIV3Schema"]
    invalid = [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
               for error in jsonschema.Draft4Validator(schema).iter_errors(pruned(kind, release, body))]
    return unknown + invalid


def _prune(value: Any, schema: dict[str, Any] | None, path: str, found: list[str], root: bool = False) -> None:
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        properties = (schema or {}).get("properties")
        extra = (schema or {}).get("additionalProperties")
        embedded = root or bool((schema or {}).get("x-kubernetes-embedded-resource"))
        for key in list(value):
            where = f"{path}.{key}" if path else key
            if embedded and key in ("apiVersion", "kind"):
                continue
            if embedded and key == "metadata" and isinstance(value[key], dict):
                for field in [name for name in value[key] if name not in OBJECT_META]:
                    found.append(f"{where}.{field}")
                    del value[key][field]
                continue
            if properties is not None and key in properties:
                _prune(value[key], properties[key], where, found)
            elif isinstance(extra, dict):
                _prune(value[key], extra, where, found)
            else:
                found.append(where)
                del value[key]
    elif isinstance(value, list):
        items = (schema or {}).get("items")
        for index, item in enumerate(value):
            _prune(item, items if isinstance(items, dict) else None, f"{path}[{index}]", found)
