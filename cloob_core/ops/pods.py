"""Each pipeline step's pod, as data: image, requests and limits, GPUs, placement, environment, secrets, volumes,
labels, annotations, deadline and retries, from the :class:`ClusterSettings` the pipeline is built for. One
description that every front renders: the Kubeflow pipeline turns it into kfp-kubernetes calls
(``pipelines/pretrain.py``), the Airflow DAGs into KubernetesPodOperator arguments, so a step's pod is the same
whichever front runs it. Imports neither kfp nor torch nor a Kubernetes client: Airflow parses its DAG files often,
in its own environment."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from cloob_core.config.cluster import ClusterSettings, cpu_count
from cloob_core.ops.trainjob import (
    CREDENTIAL_KEYS,
    DO_NOT_DISRUPT,
    ENDPOINT_KEY,
    IMAGE_UID,
    JOB_ACCOUNT_ENV,
    KUEUE_QUEUE_LABEL,
    PART_OF,
    POD_NAME_ENV,
    POD_UID_ENV,
)

Image = Literal["cpu", "cuda"]
SPILL_PATH = "/spill"  # the spill disk of a step that spills
# The folder of a spilling step's volume: the step spills there when it exists (a local run has none, and spills
# where the params say; ops/kubeflow.py).
SPILL_ENV = "CLOOB_SPILL_DIR"
SHM_PATH = "/dev/shm"
# planning, collecting, reporting, promoting (JSON and small files), and the multi-node job's watcher (API calls)
SMALL_STEP = ("500m", "1Gi")
LONG_STEP_RETRIES = 2
MAX_BACKOFF_S = 3600  # the longest wait between two tries (KFP's set_retry default; the Airflow tasks' too)


@dataclass(frozen=True)
class Retry:
    """Tries after a failure, the first wait, and its growth per try (KFP's default: it doubles)."""

    count: int
    backoff_s: int
    factor: float = 2.0


@dataclass(frozen=True)
class SecretEnv:
    """Keys of a Kubernetes secret as environment variables of the same names; an ``optional`` one may be absent."""

    secret: str
    keys: tuple[str, ...]
    optional: bool


@dataclass(frozen=True)
class Pod:
    """What a step's pod is, beside its command (the step's body, which each front starts its own way)."""

    image: Image
    cpu: str
    memory: str
    memory_limit: str | None = None
    gpus: int = 0
    accelerator: str | None = None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    node_affinity: dict[str, Any] | None = None
    env: dict[str, str] = field(default_factory=dict)
    field_env: dict[str, str] = field(default_factory=dict)  # name -> the downward API's field path
    secret_env: tuple[SecretEnv, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    shm: str | None = None  # a memory-backed /dev/shm of this size
    spill: str | None = None  # a generic ephemeral volume of this size at SPILL_PATH
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    run_as: int = IMAGE_UID  # user and group; never root
    timeout_s: int | None = None
    retry: Retry | None = None


def _base(settings: ClusterSettings, image: Image, cpu: str, memory: str, *, s3: bool = True,
          on_cpu_nodes: bool = True) -> dict[str, Any]:
    """What every step's pod gets: the settings' labels and annotations, the pull policy and secrets, with ``s3``
    the S3 credentials (required) and endpoint (optional: none on AWS S3) from the secret, and with
    ``on_cpu_nodes`` the CPU steps' node selector and tolerations (a GPU step is placed by :func:`_on_gpu_nodes`)."""
    secrets: tuple[SecretEnv, ...] = ()
    if s3 and settings.s3_secret:
        secrets = (SecretEnv(settings.s3_secret, CREDENTIAL_KEYS, optional=False),
                   SecretEnv(settings.s3_secret, (ENDPOINT_KEY,), optional=True))
    return {"image": image, "cpu": cpu, "memory": memory, "secret_env": secrets, "env": {}, "field_env": {},
            "labels": dict(settings.pod_labels), "annotations": dict(settings.pod_annotations),
            "image_pull_policy": settings.image_pull_policy, "image_pull_secrets": tuple(settings.image_pull_secrets),
            "node_selector": dict(settings.cpu_node_selector) if on_cpu_nodes else {},
            "tolerations": list(settings.cpu_tolerations) if on_cpu_nodes else []}


def _threads(cpus: int | str) -> dict[str, str]:
    """The thread budget's cores, rounded up: a request sets no quota for the process to read."""
    return {"LOKY_MAX_CPU_COUNT": str(cpu_count(str(cpus)))}


def _on_gpu_nodes(pod: dict[str, Any], settings: ClusterSettings, gpus: int,
                  node_selector: dict[str, str] | None) -> dict[str, Any]:
    """``gpus`` of the accelerator (if any), the GPU taints tolerated, the node affinity, and the labels of
    ``node_selector`` (None: the training pods')."""
    if gpus > 0:
        pod.update(gpus=gpus, accelerator=settings.accelerator)
    pod["tolerations"] = [*pod["tolerations"], *settings.gpu_tolerations()]
    pod["node_affinity"] = dict(settings.node_affinity) if settings.node_affinity else None
    pod["node_selector"] = {**pod["node_selector"],
                            **(settings.node_selector if node_selector is None else node_selector)}
    return pod


def _not_disrupted(pod: dict[str, Any]) -> dict[str, Any]:
    """Consolidation (Karpenter, the cluster autoscaler) leaves the node alone while the step runs."""
    pod["annotations"] = {**pod["annotations"], **DO_NOT_DISRUPT}
    return pod


def _long(pod: dict[str, Any]) -> dict[str, Any]:
    """A long CPU step (acquire, the gates, merge, curate): not moved by a consolidation, and tried again after a
    failure (an eviction for node pressure, an OOM kill); each resumes or redoes its work from what it wrote."""
    pod["retry"] = Retry(LONG_STEP_RETRIES, 60, 2)
    return _not_disrupted(pod)


def _data(settings: ClusterSettings, spills: bool) -> dict[str, Any]:
    """acquire, the gates and curate: the manifest-wide steps, within the engine's memory limit; with ``spills``
    on a spill disk the scheduler accounts for, named to the step in ``SPILL_ENV``."""
    pod = _long(_base(settings, "cpu", settings.data_cpu, settings.data_memory))
    pod["env"] = _threads(settings.data_cpu)
    if spills and settings.spill_disk:
        pod.update(spill=settings.spill_disk, env={**pod["env"], SPILL_ENV: SPILL_PATH})
    return pod


def _features(settings: ClusterSettings, image: Image, retry: Retry) -> dict[str, Any]:
    """A step that embeds images (scoring, the evaluation's features): on a GPU where the settings give the
    features step one (else a CPU pod off the GPU nodes), with /dev/shm for its data-loader workers."""
    gpus = settings.features_gpus()
    pod = _base(settings, image, str(settings.features_cpus()), settings.eval_memory, on_cpu_nodes=gpus == 0)
    pod.update(env=_threads(settings.features_cpus()), shm=settings.shm, retry=retry)
    if gpus > 0:
        _on_gpu_nodes(pod, settings, gpus, settings.eval_node_selector)
    return pod


def _train(settings: ClusterSettings) -> dict[str, Any]:
    """One GPU node's training pod: torchrun over its GPUs, NCCL's settings, bounded by ``job_timeout_s`` (a hung
    step does not hold a GPU node for ever), retried (the retry resumes from the checkpoints), scraped (the
    PodMonitor selects training pods by ``PART_OF``), and admitted by Kueue's pod integration with a queue."""
    cpus = settings.training_cpus()
    pod = _on_gpu_nodes(_base(settings, "cuda", str(cpus), settings.memory, on_cpu_nodes=False), settings,
                        settings.gpus, None)
    pod.update(env={**dict(sorted(settings.nccl_env.items())), **_threads(cpus)}, shm=settings.shm,
               timeout_s=math.ceil(settings.job_timeout_s),
               retry=Retry(settings.train_retries, settings.train_retry_backoff_s))
    pod["labels"] = {**pod["labels"], **PART_OF,
                     **({KUEUE_QUEUE_LABEL: settings.kueue_queue} if settings.kueue_queue else {})}
    return _not_disrupted(pod)


def _job_account(pod: dict[str, Any], settings: ClusterSettings) -> dict[str, Any]:
    """The training account the step talks to the API as, with tokens bound to its own pod (ops/trainjob.py)."""
    if settings.job_account:
        pod["env"] = {**pod["env"], JOB_ACCOUNT_ENV: settings.job_account}
        pod["field_env"] = {**pod["field_env"], POD_NAME_ENV: "metadata.name", POD_UID_ENV: "metadata.uid"}
    return pod


def pod(step: str, settings: ClusterSettings) -> Pod:
    """The pod of the pipeline step ``step`` (its name in :mod:`cloob_core.ops.graph`) for ``settings``."""
    small = _base(settings, "cpu", *SMALL_STEP)
    described: dict[str, Any]
    if step in ("acquire", "validate_manifest", "curate"):
        described = _data(settings, spills=True)
    elif step == "validate_shards":
        described = _data(settings, spills=False)
    elif step == "merge_shards":
        described = _long(small)
    elif step == "download_partition":
        described = _base(settings, "cpu", settings.download_cpu, settings.download_memory)
        described.update(memory_limit=settings.download_memory, env=_threads(settings.download_cpu),
                         retry=Retry(3, 60, 2))
    elif step == "score_partition":
        described = _features(settings, "cuda", Retry(2, 60))
    elif step == "prepare_features":
        described = _features(settings, "cuda", Retry(2, 30))
    elif step == "evaluate":
        cpus = cpu_count(settings.eval_cpu)
        described = _base(settings, "cpu", str(cpus), settings.eval_memory)
        described.update(env=_threads(cpus), retry=Retry(2, 30))
    elif step == "train":
        described = _train(settings)
    elif step == "train_multinode":
        described = _not_disrupted(_job_account(_base(settings, "cpu", *SMALL_STEP), settings))
        described["retry"] = Retry(settings.train_retries, settings.train_retry_backoff_s)
    elif step == "end_training_job":
        described = _job_account(_base(settings, "cpu", *SMALL_STEP, s3=False), settings)
    elif step in ("collect_dataset", "report"):
        described = _base(settings, "cpu", *SMALL_STEP, s3=False)
    elif step in ("plan_download", "plan_scoring", "plan_evaluation", "promote", "production_model",
                  "record_production_metrics"):
        described = small
    else:
        raise KeyError(f"no pipeline step {step!r}")
    return Pod(**described)
