"""A stand-in for the Kubeflow Pipelines API server (the v2beta1 REST endpoints kfp.Client calls), on 127.0.0.1:
it records every request and answers with what the real server would return, so tests can check what our
submit and schedule commands ask the cluster to do."""

from __future__ import annotations

import itertools
import json
import re
from urllib.parse import parse_qs

from json_api_server import JsonApiServer

NOW = "2026-11-22T00:00:00Z"


def _display_name_filter(query: str) -> str | None:
    """The display name an ``experiments?filter=`` query asks for (the client looks experiments up by name)."""
    raw = parse_qs(query).get("filter", [None])[0]
    if not raw:
        return None
    for predicate in json.loads(raw).get("predicates", []):
        if predicate.get("key") in ("display_name", "name"):
            return predicate.get("string_value") or predicate.get("stringValue")
    return None


class KfpApiServer(JsonApiServer):
    def __init__(self) -> None:
        self.experiments: dict[str, dict] = {}
        self.recurring: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self._ids = itertools.count(1)
        super().__init__()

    def _answer(self, method: str, path: str, query: str, body: dict) -> tuple[int, dict]:
        base = "/apis/v2beta1"
        if path == f"{base}/healthz":
            return 200, {"multi_user": False, "pipeline_store": "database"}
        if path == f"{base}/experiments" and method == "POST":
            experiment_id = f"exp-{next(self._ids)}"
            experiment = {**body, "experiment_id": experiment_id, "created_at": NOW, "storage_state": "AVAILABLE"}
            self.experiments[experiment_id] = experiment
            return 200, experiment
        if path == f"{base}/experiments" and method == "GET":
            wanted = _display_name_filter(query)
            found = [e for e in self.experiments.values() if wanted is None or e.get("display_name") == wanted]
            return 200, {"experiments": found, "total_size": len(found)}
        match = re.fullmatch(f"{base}/experiments/([^/]+)", path)
        if match and method == "GET":
            found = self.experiments.get(match.group(1))
            return (200, found) if found else (404, {"error": "not found", "code": 5})
        if path == f"{base}/runs" and method == "POST":
            run_id = f"run-{next(self._ids)}"
            run = {**body, "run_id": run_id, "state": "PENDING", "created_at": NOW}
            self.runs[run_id] = run
            return 200, run
        if path == f"{base}/recurringruns" and method == "POST":
            recurring_id = f"rr-{next(self._ids)}"
            recurring = {**body, "recurring_run_id": recurring_id, "status": "ENABLED", "created_at": NOW}
            self.recurring[recurring_id] = recurring
            return 200, recurring
        if path == f"{base}/recurringruns" and method == "GET":
            return 200, {"recurringRuns": list(self.recurring.values()), "total_size": len(self.recurring)}
        match = re.fullmatch(f"{base}/recurringruns/([^/:]+)", path)
        if match and method == "DELETE":
            return (200, {}) if self.recurring.pop(match.group(1), None) else (404, {"error": "not found", "code": 5})
        return 404, {"error": f"no such endpoint {method} {path}", "code": 5}
