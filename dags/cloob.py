"""The CLOOB pipelines as Airflow DAGs: cloob_pretrain, cloob_nightly and cloob_evaluate (pipelines/airflow_dags.py;
docs/airflow.md). Settings: the YAML file CLOOB_AIRFLOW_SETTINGS names (cloob_core/config/airflow.py), else local
mode on the packaged default. Parsed in Airflow's venv: the repository's root goes on the path for its light
modules (the settings, the graph, the pods' declarations); the stages run in the steps' own environments."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.airflow_dags import dags

_made = dags()
cloob_pretrain = _made["cloob_pretrain"]
cloob_nightly = _made["cloob_nightly"]
cloob_evaluate = _made["cloob_evaluate"]
