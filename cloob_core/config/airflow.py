"""How the Airflow DAGs run (``pipelines/airflow_dags.py``): locally, each task a process of the project's venv as
`dvc repro` runs a stage, or on Kubernetes, each task the pod the Kubeflow pipeline gives that step for the same
:class:`ClusterSettings`. Read when Airflow parses the DAG file (from the YAML file ``CLOOB_AIRFLOW_SETTINGS``
names, else these defaults), in Airflow's own venv: pydantic and PyYAML only."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cloob_core.config.base import ConfigError, describe
from cloob_core.config.cluster import ClusterSettings

SETTINGS_ENV = "CLOOB_AIRFLOW_SETTINGS"


class AirflowSettings(BaseModel):
    """The Airflow front's settings; ``cluster`` is the Kubeflow pipeline's (the graph and each step's pod)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["local", "kubernetes"] = Field(
        "local", description="local: each task runs its stage on the Airflow worker's machine, in `python`'s venv; "
        "kubernetes: each task is a pod (KubernetesPodOperator) with the step's image and resources.")
    runs: str = Field("runs/airflow", description="Where each run's steps publish their outputs "
                      "(<runs>/<DAG>/<run>/<task>): a folder (relative: to the repository), or with mode kubernetes "
                      "an s3:// prefix the pods share. Local runs also keep their shards, training checkpoints and "
                      "model registry under it.")
    python: str = Field(".venv/bin/python", description="mode local: the interpreter of the project's venv "
                        "(relative: to the repository) that runs each task; Airflow's own venv lacks torch.")
    namespace: str = Field("default", description="mode kubernetes: the namespace of the pods.")
    kubernetes_conn_id: str | None = Field(None, description="mode kubernetes: Airflow's Kubernetes connection "
                                           "(null: in the cluster, the worker's service account).")
    service_account: str | None = Field(None, description="mode kubernetes: the service account the pods run as "
                                        "(null: the namespace's default), as `python -m pipelines submit "
                                        "--service-account` gives a Kubeflow run's.")
    cpu_image: str | None = Field(None, description="mode kubernetes: the CPU steps' image (null: the one the "
                                  "compiled Kubeflow pipeline names, components/images.py: CLOOB_IMAGE_CPU or the "
                                  "build's tag).")
    cuda_image: str | None = Field(None, description="mode kubernetes: the GPU steps' image (null: as cpu_image, "
                                   "CLOOB_IMAGE_CUDA).")
    api_url: str | None = Field(None, description="mode kubernetes: the Airflow API server's URL as the pods reach "
                                "it (e.g. http://airflow-api-server.airflow:8080). The multi-node training's watcher "
                                "asks it whether its run was stopped (marked failed, cleared) when it gets SIGTERM, "
                                "and deletes the job then; null: it cannot tell, leaves the job to the run's teardown "
                                "task and its deadline.")
    api_secret: str | None = Field(None, description="mode kubernetes: the Kubernetes secret with the Airflow API's "
                                   "credentials for api_url: AIRFLOW_API_USERNAME and AIRFLOW_API_PASSWORD (a user "
                                   "who may read DAG runs and task instances), or AIRFLOW_API_TOKEN.")
    nightly_schedule: str = Field("0 2 * * *", description="cloob_nightly's cron (UTC): the scheduled retraining.")
    nightly_timeout_s: float = Field(20 * 3600.0, gt=0, description="cloob_nightly's dagrun_timeout: shorter "
                                     "than its period, so a run that overruns ends before the next one is due.")
    evaluate_schedule: str | None = Field("0 6 * * 0", description="cloob_evaluate's cron (UTC); null: run by hand.")
    shards_uri: str = Field("", description="cluster.data import: the shards the DAGs' runs train on by default "
                            "(a folder or an s3:// prefix; a run's `shards_uri` param overrides it).")
    step_timeout_s: float = Field(2 * 86400.0, gt=0, description="Execution timeout of each step that has none "
                                  "of its own (training has the cluster settings' job_timeout_s).")
    cluster: ClusterSettings = Field(default_factory=ClusterSettings,
                                     description="The cluster settings (python -m pipelines compile's flags).")

    @model_validator(mode="after")
    def _fits_the_mode(self) -> AirflowSettings:
        if self.mode == "local" and self.cluster.nodes > 1:
            raise ValueError("mode local trains on this machine: cluster.nodes must be 1")
        if self.api_url is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", self.api_url):
            raise ValueError(f"api_url must be an http:// or https:// URL, not {self.api_url!r}")
        if self.api_url is not None and not self.api_secret:
            raise ValueError("api_url needs api_secret: the secret with the Airflow API's credentials")
        if self.mode == "kubernetes" and not self.runs.startswith("s3://"):
            raise ValueError(f"mode kubernetes: runs must be an s3:// prefix the pods share, not {self.runs!r}")
        return self

    def located(self, repository: Path) -> AirflowSettings:
        """These settings with relative local paths made absolute under ``repository``, and in local mode the
        cluster's stores under ``runs`` (the shards, the training's checkpoints) and no GPU for training unless
        the cluster settings file gave them, as `python -m pipelines run-local` does."""
        runs = self.runs if self.runs.startswith("s3://") else str((repository / self.runs).resolve())
        python = str(repository / self.python) if not Path(self.python).is_absolute() else self.python
        cluster = self.cluster
        if self.mode == "local":
            given = self.cluster.model_fields_set
            local = {"shards_store": f"{runs}/shards", "job_workdir": f"{runs}/jobs", "gpus": 0}
            cluster = cluster.model_copy(update={key: value for key, value in local.items() if key not in given})
        else:
            cluster = cluster.for_cluster()
        return self.model_copy(update={"runs": runs, "python": python, "cluster": cluster})

    def output_of(self, dag_id: str, run_id: str, task_id: str, map_index: int | None = None) -> str:
        """Where a task's step publishes its files: one folder per run and task (and mapped index), the same for
        each try of it, so a retry republishes in place."""
        run = re.sub(r"[^A-Za-z0-9._-]+", "-", run_id).strip("-")
        index = f"-{map_index}" if map_index is not None and map_index >= 0 else ""
        return f"{self.runs.rstrip('/')}/{dag_id}/{run}/{task_id}{index}"

    @classmethod
    def load(cls, path: str | None = None) -> AirflowSettings:
        """The settings in the YAML file ``path`` (default: the one ``CLOOB_AIRFLOW_SETTINGS`` names; none: the
        defaults); a wrong key or value fails in one line naming it."""
        path = path or os.environ.get(SETTINGS_ENV)
        values = {}
        if path:
            try:
                values = yaml.safe_load(Path(path).read_text("utf-8")) or {}
            except (OSError, yaml.YAMLError) as err:
                raise ConfigError(f"Airflow settings {path}: {err}") from None
            if not isinstance(values, dict):
                raise ConfigError(f"Airflow settings {path}: a mapping, not {type(values).__name__}")
        try:
            return cls(**values)
        except ValidationError as err:
            raise ConfigError(describe(err, "Airflow settings")) from None
