"""The repository's params.yaml as one line of JSON (JSON is YAML): every front's default run parameters. One line:
a multi-line default breaks the comment header KFP's compiler writes, and a KFP struct parameter cannot hold
nulls. Imports PyYAML alone (Airflow parses the DAGs that read it)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

PARAMS_FILE = Path(__file__).resolve().parents[1] / "params.yaml"
DEFAULT_PARAMS = json.dumps(yaml.safe_load(PARAMS_FILE.read_text("utf-8")))
