"""Where and how the pipeline runs on Kubernetes: the settings fixed when it is compiled (pod resources and
scheduling are part of the pod spec, not run parameters). One model, read by the pipeline builder and the
multi-node training job alike; `python -m pipelines compile` has one flag per field, generated from it."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cloob_core.config.base import ConfigError, describe

MAX_DOWNLOAD_GROUPS = 256  # iterations of the download loop: Argo keeps every node's status in one etcd object
# NCCL in a multi-node job, unless the settings say otherwise: errors end the job instead of hanging it (torch's
# async error handling), and NCCL logs its warnings and the transport it chose, which is what to read first when
# two nodes are slow (NET/IB against NET/Socket).
NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
# NCCL over AWS EFA through the aws-ofi-nccl plugin: libfabric's EFA provider, GPUDirect RDMA (p4d, p5), and
# fork safety (the data loader forks its workers after libfabric registered memory).
EFA_NCCL_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
EFA_RESOURCE = "vpc.amazonaws.com/efa"
# Ports node agents hold on a GPU node's own network: a multi-node pod on the host network cannot serve its metrics
# there (the run fails with Errno 98 at its first step).
NODE_AGENT_PORTS = {9100: "node-exporter", 9400: "NVIDIA dcgm-exporter", 10249: "kube-proxy's metrics",
                    10250: "the kubelet", 10256: "kube-proxy's health check"}


# Kubernetes' quantity grammar (resource.Quantity): a number and a binary (Ki..Ei) or decimal (m, k, M..E) suffix or
# an exponent. "32GB" and "lots" are not quantities: the API server refuses them, and the run would have failed
# after its download.
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?$")
# A label's name part, and a DNS subdomain: its prefix, and an extended resource's.
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def quantity_error(value: str) -> str | None:
    """Why ``value`` is not a Kubernetes quantity (e.g. 32Gi, 500m, 2G), or None."""
    if not _QUANTITY.match(value.strip()):
        hint = " (bytes are Gi or G, not GB)" if value.strip().upper().endswith("B") else ""
        return f"not a Kubernetes quantity: {value!r}{hint}; e.g. 32Gi, 2G, 500m"
    return None


def label_key_error(key: str, what: str = "a label key") -> str | None:
    """Why ``key`` is not a label key (an annotation's key has the same form: an optional DNS-subdomain prefix and
    '/', then a name of at most 63 characters), or None."""
    prefix, _, name = key.rpartition("/")
    if not _LABEL_NAME.match(name) or (prefix and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix))):
        return f"not {what}: {key!r} (e.g. pool, node.kubernetes.io/instance-type)"
    return None


def label_value_error(value: str) -> str | None:
    if value and not _LABEL_NAME.match(value):
        return f"not a label value: {value!r} (at most 63 letters, digits, '-', '_', '.')"
    return None


def resource_name_error(name: str, vendor_domain: bool = False) -> str | None:
    """Why ``name`` is not an extended resource a device plugin advertises (a prefix, '/', a name:
    nvidia.com/gpu, rdma/rdma_shared_device_a), or None. With ``vendor_domain`` its prefix must be a domain, as
    every accelerator's device plugin names it (nvidia.com, amd.com, gpu.intel.com, habana.ai)."""
    prefix, _, rest = name.partition("/")
    if not rest or not _SUBDOMAIN.match(prefix) or not _LABEL_NAME.match(rest) or prefix.endswith("kubernetes.io") \
            or (vendor_domain and "." not in prefix):
        example = "nvidia.com/gpu" if vendor_domain else "rdma/rdma_shared_device_a"
        return f"not a device plugin's resource name: {name!r} (a {'domain' if vendor_domain else 'prefix'}, " \
               f"'/', a name: e.g. {example})"
    return None


TOLERATION_FIELDS = {"key", "operator", "value", "effect", "tolerationSeconds"}
NODE_AFFINITY_FIELDS = {"requiredDuringSchedulingIgnoredDuringExecution",
                        "preferredDuringSchedulingIgnoredDuringExecution"}


def toleration_error(toleration: Any) -> str | None:
    """Why ``toleration`` is not a Kubernetes Toleration, or None."""
    if not isinstance(toleration, dict) or set(toleration) - TOLERATION_FIELDS:
        return f"not a toleration: {toleration!r} (fields {', '.join(sorted(TOLERATION_FIELDS))})"
    if toleration.get("operator", "Equal") not in ("Equal", "Exists"):
        return f"toleration operator {toleration['operator']!r} is not Equal or Exists"
    if toleration.get("effect", "") not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
        return f"toleration effect {toleration['effect']!r} is not NoSchedule, PreferNoSchedule or NoExecute"
    if toleration.get("operator") == "Exists" and toleration.get("value"):
        return f"toleration {toleration!r}: operator Exists takes no value"
    return None


def cpu_count(quantity: str) -> int:
    """A Kubernetes CPU quantity ("8", "500m", "2.5") as whole CPUs, rounded up."""
    text = quantity.strip()
    value = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    return max(1, math.ceil(value))


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data: Literal["acquire", "import"] = Field(
        "acquire", description="acquire: build the shards in the run; import: train on shards already on S3, given "
        "as the run parameter shards_uri (e.g. a DVC worktree remote's data/shards)")
    partitions: int = Field(256, ge=1, description="Most download groups: the run's planning step cuts the shards "
                            f"into min(this, {MAX_DOWNLOAD_GROUPS}, the shard count) contiguous ranges, one pod each.")
    download_parallelism: int = Field(32, ge=1, description="Download pods running at once (the loop's "
                                      "parallelism): size it to the nodes and the sites' politeness, not the data.")
    shards_store: str = Field(
        "s3://cloob/shards", min_length=1, description="Where the run builds its shards and its steps read them "
        "in place (never copied into a pod): an s3:// prefix on a cluster; one folder per manifest and settings.")
    curation: bool = Field(False, description="Curate before training: the shards scored by curation.scorer (a "
                           "fan-out over contiguous ranges of shards, min(partitions, shards) of them, one GPU pod "
                           "each where gpus > 0), curated by the run's curation section, and the shard gate and "
                           "training on the curated shards; the run's params need curation.enabled "
                           "(docs/curation.md).")
    scoring_parallelism: int = Field(8, ge=1, description="Scoring pods running at once (with curation): each holds "
                                     "one GPU where gpus > 0, so size it to the GPUs the scoring may take.")
    nodes: int = Field(1, ge=1, description="Training nodes; >1 creates a Training Operator job with `gpus` per node.")
    gpus: int = Field(1, ge=0, description="GPUs per training node; >1 runs torchrun, one process per GPU.")
    accelerator: str = Field("nvidia.com/gpu", description="Accelerator resource name.")
    cpu: str = Field("8", description="CPU request of a training pod without GPUs (with GPUs: cpu_per_gpu).")
    cpu_per_gpu: int = Field(11, ge=1, description="CPUs a training pod requests per GPU, and the cores its thread "
                             "budget splits: the data-loader workers decode on them (a ViT-B/32 step on an H100 "
                             "needs ~4,000 samples/s, ~470 per core at 224 px; docs/performance.md, \"Feeding a "
                             "GPU\"). 11 fits the 96-vCPU 8-GPU nodes (p4d.24xlarge, a2-highgpu-8g: 88 requested, "
                             "the rest for the kubelet's reserve and the DaemonSets); size it to the node, "
                             "(vCPUs - 4) / GPUs (docs/kubernetes.md, \"Node shapes\").")
    nccl_env: dict[str, str] = Field(
        default_factory=lambda: dict(NCCL_DEFAULTS), description="Environment of the training pods (one node or a "
        "multi-node job's) for NCCL and torch's NCCL layer (e.g. NCCL_SOCKET_IFNAME=eth0, NCCL_IB_HCA=mlx5); given "
        "values replace the defaults of the same name (docs/kubernetes.md, \"Several nodes\").")
    host_network: bool = Field(False, description="Multi-node pods on the node's network (hostNetwork, "
                               "ClusterFirstWithHostNet DNS): NCCL then reaches the node's fast interfaces; needs a "
                               "namespace that allows it.")
    metrics_port: int = Field(9401, ge=1024, le=65535, description="Port a multi-node job's pods serve Prometheus "
                              "/metrics on (the PodMonitor finds it by its name, metrics). With host_network it is "
                              "the node's port: not one a node agent holds (dcgm-exporter's 9400, node-exporter's "
                              "9100, the kubelet's).")
    rdma_resources: dict[str, str] = Field(default_factory=dict, description="Extra resources each multi-node pod "
                                           "asks for, e.g. rdma/rdma_shared_device_a=1 (the NVIDIA network "
                                           "operator's InfiniBand/RoCE devices); NCCL uses them when present.")
    efa_devices: int = Field(0, ge=0, description="AWS EFA devices each multi-node pod asks for "
                             "(vpc.amazonaws.com/efa: 4 on p4d.24xlarge, 32 on p5.48xlarge), with libfabric's EFA "
                             "settings for NCCL (FI_PROVIDER=efa, FI_EFA_USE_DEVICE_RDMA=1, FI_EFA_FORK_SAFE=1) "
                             "beneath nccl_env; the image needs libfabric and the aws-ofi-nccl plugin "
                             "(docs/kubernetes.md, \"EFA\").")
    memory: str = Field("32Gi", description="Training pod memory request.")
    download_cpu: str = Field("8", description="CPU request of each download pod; its worker processes (one per "
                              "core) decode and resize on them (docs/scale.md: about 200 images/s per core).")
    download_memory: str = Field("2Gi", description="Memory request and limit of each download pod: about 200 MB for "
                                 "the main process and 170 MB per worker (docs/scale.md), so 2Gi for 8 workers; "
                                 "grow it with download_cpu. A worker killed at the limit says so.")
    data_cpu: str = Field("2", description="CPU request of acquire and the two data gates (DuckDB and Great "
                          "Expectations over the manifest, the shards' records).")
    data_memory: str = Field("2Gi", description="Memory request of acquire and the two data gates: LAION-400M's "
                             "acquire peaked at 1 GB and its gate at 0.6 GB (docs/scale.md), within "
                             "engine.memory_limit.")
    spill_disk: str | None = Field("40Gi", description="Disk of each step that spills (acquire, the manifest gate, "
                                   "curate): a generic ephemeral volume of the cluster's default storage class, "
                                   "their engine.spill_dir and temporary folder. Size it for the largest: acquire's "
                                   "URL dedup is about the manifest's URL column (35 GB for LAION-400M), curation's "
                                   "20 GB to 1 TB (docs/scale.md); '' for none (the container's own disk).")
    run_timeout_s: float = Field(
        30 * 86400.0, ge=0, description="Seconds a whole run may take (its Argo Workflow's activeDeadlineSeconds): "
        "what ends a step whose pod is never scheduled (a pod's own deadline counts from its start); above "
        "job_timeout_s, as data steps run before training. 0 for none.")
    shm: str = Field("16Gi", description="Size of the training pods' memory-backed /dev/shm (DataLoader workers).")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the training pods need.")
    pod_labels: dict[str, str] = Field(default_factory=dict, description="Labels of every pod: each step's and each "
                                       "multi-node job pod's (a cost centre, a Kueue queue name, a team).")
    pod_annotations: dict[str, str] = Field(default_factory=dict, description="Annotations of every pod: each step's "
                                            "and each multi-node job pod's.")
    job_pod_annotations: dict[str, str] = Field(
        default_factory=lambda: {"sidecar.istio.io/inject": "false"}, description="Annotations of the multi-node job "
        "pods, over pod_annotations. By default Istio's sidecar is kept out: in a Kubeflow profile namespace it "
        "breaks the pods' rendezvous (kubeflow/trainer #1637, #2794); '{}' for none.")
    gpu_taint: str | None = Field("nvidia.com/gpu", description="Taint key the training pods tolerate ('' for none).")
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list, description="More tolerations of the GPU pods (training, the evaluation's features "
        "step, a multi-node job's), as Kubernetes Toleration objects: a spot pool's taint, a NoExecute one.")
    node_affinity: dict[str, Any] | None = Field(
        None, description="Node affinity of the GPU pods, as a Kubernetes NodeAffinity object (required and "
        "preferred terms: a zone, an instance family).")
    eval_node_selector: dict[str, str] | None = Field(
        None, description="Node labels of the evaluation's GPU features step (null: node_selector): a one-GPU step "
        "need not hold a whole training node.")
    cpu_node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels of every CPU step (the "
                                              "data steps, evaluation tasks, the reports, the job's watcher): their "
                                              "own node pool.")
    cpu_tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations of every CPU step "
                                                  "(Kubernetes Toleration objects).")
    priority_class: str | None = Field(None, description="PriorityClass of a multi-node PyTorchJob's pods (and its "
                                       "gang, with gang_scheduling); a TrainJob's comes from its runtime.")
    scheduler_name: str | None = Field(None, description="Scheduler of a multi-node PyTorchJob's pods (volcano, "
                                       "scheduler-plugins' coscheduling); a TrainJob's comes from its runtime.")
    gang_scheduling: bool = Field(False, description="A multi-node PyTorchJob starts all its pods or none "
                                  "(runPolicy.schedulingPolicy.minAvailable = nodes), for a scheduler that gangs "
                                  "(scheduler_name); Kueue admits a job whole without it.")
    kueue_queue: str | None = Field(None, description="Kueue LocalQueue of the training: the label "
                                    "kueue.x-k8s.io/queue-name on the multi-node job, or on the one-node training "
                                    "pod (Kueue's pod integration).")
    eval_gpus: int | None = Field(
        None, ge=0, description="GPUs of the evaluation's features step (each data set's images embedded once): "
        "default 1 where training has GPUs, else 0; 0: a CPU pod. It runs with the training pods' accelerator, "
        "taint toleration, node selector and /dev/shm, and cpu_per_gpu CPUs per GPU for its data-loader workers.")
    eval_cpu: str = Field("4", description="CPU request of the evaluation's CPU pods: the features step without a "
                          "GPU, and the task steps (probe, zero-shot, retrieval on the computed features).")
    eval_memory: str = Field("16Gi", description="Memory request of every evaluation pod (the features of a data "
                             "set: N x d floats, 2 GB for 1M images at d=512, and the model).")
    s3_secret: str | None = Field("cloob-s3", description="Kubernetes secret with the S3 credentials (and endpoint), "
                                  "given to the steps as environment variables; required: a pod whose secret is "
                                  "missing does not start ('' for none, e.g. with IRSA).")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent", description="When the nodes pull the images: IfNotPresent suits tags that name one build "
        "(VERSION-commit, components/image_names.py); a TrainJob's trainer pulls as its runtime says.")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets (docker-registry type) with "
                                          "which every pod pulls its image from a private registry.")
    service_account: str | None = Field(None, description="Service account of the multi-node job's pods (the "
                                        "pipeline's own steps run as the run's: `submit --service-account`).")
    job_account: str | None = Field(
        "cloob-pipeline", description="Service account (infra/k8s) the multi-node training step and the run's exit "
        "handler talk to the API as, to create, watch and delete the job: they request short-lived tokens of it "
        "(TokenRequest: an hour each, bound to the step's pod, renewed), so no long-lived token is stored and the "
        "account every step runs as holds only the right to request them (Role cloob-training-token), no rights over "
        "training jobs. '' for none (the run's own account must then hold the Role cloob-training-jobs).")
    job_kind: Literal["pytorchjob", "trainjob"] = Field(
        "pytorchjob", description="pytorchjob (Training Operator v1) or trainjob (Kubeflow Trainer v2).")
    job_workdir: str = Field("s3://cloob/jobs", description="s3:// prefix where a training run keeps what must "
                             "outlive its pods, in a folder per run: its checkpoints (a retried pod resumes from "
                             "them) and a multi-node job's result.")
    train_retries: int = Field(3, ge=0, description="Retries of the training step (one node: its pod; several: the "
                               "job's watcher, which adopts the running job). A retried pod resumes from the run's "
                               "last checkpoint in job_workdir (--resume auto).")
    train_retry_backoff_s: int = Field(60, ge=0, description="Seconds before the first retry of the training step "
                                       "(doubling after each).")
    job_namespace: str | None = Field(None, description="Namespace of the multi-node job (default: the pipeline "
                                      "pod's own).")
    job_runtime: str = Field("torch-distributed", description="Trainer v2 ClusterTrainingRuntime of a trainjob.")
    trainer_release: Literal["v2.1", "v2.2", "v2.3"] = Field(
        "v2.3", description="Kubeflow Trainer release of the cluster, for a trainjob: v2.2 and v2.3 take the pods' "
        "settings as runtimePatches, with a deadline and a security context; v2.1 as podTemplateOverrides, with "
        "neither (its runtime must carry the context) (docs/kubernetes.md, \"Versions\").")
    job_backoff_limit: int = Field(3, ge=0, description="Pod restarts before the job fails; each restart resumes "
                                   "from the last checkpoint.")
    keep_checkpoints: bool = Field(False, description="Keep a run's mirrored checkpoints (job_workdir/<run>/"
                                   "checkpoints) after it succeeded; by default the training step deletes them once "
                                   "the model is out (only a failed or unfinished run resumes from them).")
    job_disruption_budget: bool = Field(
        False, description="Give each multi-node job a PodDisruptionBudget of its own (minAvailable: all its pods, "
        "owned by the job): a drain (kubectl drain, a managed node upgrade) then waits for the job to end instead "
        "of evicting a pod, which restarts it from its last checkpoint. Off: the pods carry "
        "karpenter.sh/do-not-disrupt and safe-to-evict: false, which keep consolidation away, and a drain restarts "
        "them (docs/kubernetes.md, \"Disruptions\").")
    job_keep_failed: bool = Field(False, description="Keep a failed multi-node job (its ended pods and their logs) "
                                  "for inspection instead of deleting it once its pods' exit codes and last log "
                                  "lines are in the step's log; a PyTorchJob is then deleted job_ttl_s after it ends, "
                                  "a TrainJob with its run.")
    job_ttl_s: int = Field(86400, ge=0, description="Seconds a finished PyTorchJob (with its ended pods and their "
                           "logs) stays before the Training Operator deletes it (ttlSecondsAfterFinished); a "
                           "TrainJob has no such field and goes with its run's Workflow, which owns it.")
    job_timeout_s: float = Field(7 * 24 * 3600.0, gt=0, description="Seconds training may run: a multi-node job's "
                                 "activeDeadlineSeconds (it is deleted then), the one-node training pod's (each "
                                 "try's).")
    job_pending_timeout_s: float = Field(3600.0, gt=0, description="Seconds a multi-node job's pods may wait to "
                                         "start (unschedulable: no GPUs free, a quota refused, an image not "
                                         "pulled); the watcher logs why from their Events and, past this, deletes "
                                         "the job and fails with that reason.")
    job_queue_timeout_s: float = Field(86400.0, gt=0, description="Seconds a multi-node job may wait suspended in "
                                       "a queue (Kueue holds a job that way until it admits it) before the watcher "
                                       "deletes it; the wait is logged with the queue's name, the job's position "
                                       "and why no quota is reserved. Once admitted, pod start-up is Kueue's "
                                       "(waitForPodsReady), not job_pending_timeout_s.")
    job_stop_grace_s: float = Field(20.0, gt=0, le=600, description="Seconds the multi-node step's watcher takes "
                                    "after a SIGTERM to tell a stopped run from a drain (its Workflow read) and end "
                                    "in one line: within the pod's termination grace period (30 s by default).")
    job_poll_s: float = Field(20.0, gt=0, description="Seconds between looks at the job's status; after an API "
                              "fault, the first wait before asking again (doubling, at most 5 minutes).")
    job_api_timeout_s: float = Field(60.0, gt=0, description="Deadline of each Kubernetes API call of the job's "
                                     "watcher (the client sets none); one that passes is retried, never ends the job.")
    image: str = Field("", description="The job pods' image; filled with the training image when the pipeline is "
                       "compiled.")

    @field_validator("nccl_env", mode="before")
    @classmethod
    def _over_the_defaults(cls, value: Any) -> Any:
        return {**NCCL_DEFAULTS, **value} if isinstance(value, dict) else value

    @field_validator("cpu", "eval_cpu", "download_cpu", "data_cpu")
    @classmethod
    def _a_cpu_quantity(cls, value: str) -> str:
        try:
            cpu_count(value)
        except ValueError:
            raise ValueError(f"not a CPU quantity: {value!r} (e.g. 8, 500m)") from None
        return value

    @field_validator("memory", "shm", "eval_memory", "download_memory", "data_memory")
    @classmethod
    def _a_quantity(cls, value: str) -> str:
        error = quantity_error(value)
        if error:
            raise ValueError(error)
        return value

    @field_validator("spill_disk")
    @classmethod
    def _a_disk_quantity(cls, value: str | None) -> str | None:
        error = quantity_error(value) if value else None
        if error:
            raise ValueError(error)
        return value or None

    @field_validator("node_selector", "pod_labels", "eval_node_selector", "cpu_node_selector")
    @classmethod
    def _labels(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key, label in (value or {}).items():
            error = label_key_error(key) or label_value_error(label)
            if error:
                raise ValueError(error)
        return value

    @field_validator("pod_annotations", "job_pod_annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            error = label_key_error(key, "an annotation key")
            if error:
                raise ValueError(error)
        return value

    @field_validator("accelerator")
    @classmethod
    def _a_resource(cls, value: str) -> str:
        error = resource_name_error(value, vendor_domain=True)
        if error:
            raise ValueError(error)
        return value

    @field_validator("rdma_resources")
    @classmethod
    def _resources(cls, value: dict[str, str]) -> dict[str, str]:
        for name, count in value.items():
            error = resource_name_error(name) or (None if str(count).isdigit() else
                                                  f"{name}: a device count, not {count!r}")
            if error:
                raise ValueError(error)
        return value

    @field_validator("tolerations", "cpu_tolerations")
    @classmethod
    def _tolerations(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for toleration in value:
            error = toleration_error(toleration)
            if error:
                raise ValueError(error)
        return value

    @field_validator("node_affinity")
    @classmethod
    def _node_affinity(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = set(value or {}) - NODE_AFFINITY_FIELDS
        if unknown:
            raise ValueError(f"node_affinity: {sorted(unknown)} are not NodeAffinity fields "
                             f"({', '.join(sorted(NODE_AFFINITY_FIELDS))})")
        return value or None

    @field_validator("gpu_taint", "s3_secret", "service_account", "job_namespace", "job_account",
                     "priority_class", "scheduler_name", "kueue_queue", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value

    @model_validator(mode="after")
    def _job_needs_a_workdir(self) -> ClusterSettings:
        if self.nodes > 1 and not self.job_workdir.startswith("s3://"):
            raise ValueError(f"a multi-node job needs a work folder its pods share (an s3:// prefix), not "
                             f"{self.job_workdir!r}")
        return self

    @model_validator(mode="after")
    def _a_run_outlasts_its_training(self) -> ClusterSettings:
        if self.run_timeout_s and self.run_timeout_s <= self.job_timeout_s:
            raise ValueError(f"run_timeout_s ({self.run_timeout_s:.0f}) must be above job_timeout_s "
                             f"({self.job_timeout_s:.0f}): the run's deadline would end its training first")
        return self

    @model_validator(mode="after")
    def _metrics_port_free_on_the_node(self) -> ClusterSettings:
        if self.host_network and self.metrics_port in NODE_AGENT_PORTS:
            raise ValueError(f"metrics_port {self.metrics_port} is {NODE_AGENT_PORTS[self.metrics_port]}'s port on "
                             "the node, and host_network serves the training pods' metrics there: choose another "
                             f"(default {type(self).model_fields['metrics_port'].default})")
        return self

    @model_validator(mode="after")
    def _what_a_trainjob_can_set(self) -> ClusterSettings:
        if self.nodes == 1 or self.job_kind != "trainjob":
            return self
        runtime = [name for name in ("host_network", "priority_class", "scheduler_name", "gang_scheduling")
                   if getattr(self, name)]
        if runtime:
            raise ValueError(f"{', '.join(runtime)} with job_kind trainjob: a TrainJob cannot set them (neither "
                             "podTemplateOverrides nor runtimePatches has them); set them in the "
                             "ClusterTrainingRuntime named by job_runtime, or use job_kind pytorchjob")
        return self

    @model_validator(mode="after")
    def _a_gang_needs_its_scheduler(self) -> ClusterSettings:
        if self.gang_scheduling and not self.scheduler_name:
            raise ValueError("gang_scheduling needs scheduler_name: the scheduler that gangs (volcano, "
                             "scheduler-plugins); the default scheduler ignores minAvailable")
        return self

    @model_validator(mode="after")
    def _only_what_reaches_a_pod(self) -> ClusterSettings:
        """Settings that only a multi-node job's pods can take, refused for one node rather than dropped: a KFP
        step has no host network or extra resources, and runs as the run's service account."""
        if self.nodes > 1:
            return self
        unusable = []
        if self.host_network:
            unusable.append("host_network (a KFP step cannot join the node's network)")
        if self.rdma_resources:
            unusable.append("rdma_resources (a KFP step takes one accelerator resource; RDMA matters across nodes)")
        if self.efa_devices:
            unusable.append("efa_devices (a KFP step takes one accelerator resource; EFA matters across nodes)")
        if self.service_account:
            unusable.append("service_account (a KFP step runs as the run's service account: give it to `submit` "
                            "or `schedule create` as --service-account)")
        for name in ("priority_class", "scheduler_name"):
            if getattr(self, name):
                unusable.append(f"{name} (a KFP step's pod cannot be given one)")
        if self.gang_scheduling:
            unusable.append("gang_scheduling (one pod is no gang)")
        if unusable:
            raise ValueError(f"with nodes 1 these apply to no pod: {'; '.join(unusable)}")
        return self

    def for_cluster(self) -> ClusterSettings:
        """These settings, checked for pods that share nothing but object storage."""
        if self.data == "acquire" and not self.shards_store.startswith("s3://"):
            raise ConfigError(f"cluster settings: shards_store must be an s3:// prefix the pods share, not "
                              f"{self.shards_store!r}")
        if not self.job_workdir.startswith("s3://"):
            raise ConfigError(f"cluster settings: job_workdir must be an s3:// prefix (a retried training pod "
                              f"resumes from the checkpoints kept there), not {self.job_workdir!r}")
        return self

    @classmethod
    def from_flags(cls, values: dict[str, Any]) -> ClusterSettings:
        try:
            return cls(**values)
        except ValidationError as err:
            raise ConfigError(describe(err, "cluster settings")) from None

    def training_cpus(self) -> int:
        """CPUs a training pod requests: ``cpu_per_gpu`` per GPU, or ``cpu`` (rounded up) without GPUs."""
        return self.gpus * self.cpu_per_gpu if self.gpus > 0 else cpu_count(self.cpu)

    def gpu_tolerations(self) -> list[dict[str, Any]]:
        """What the GPU pods tolerate: the GPU taint, then ``tolerations``."""
        taint = [{"key": self.gpu_taint, "operator": "Exists", "effect": "NoSchedule"}] if self.gpu_taint else []
        return [*taint, *self.tolerations]

    def features_gpus(self) -> int:
        """GPUs of the evaluation's features step: ``eval_gpus``, by default 1 where training has GPUs."""
        if self.eval_gpus is not None:
            return self.eval_gpus
        return 1 if self.gpus > 0 else 0

    def features_cpus(self) -> int:
        """CPUs the features step requests: ``cpu_per_gpu`` per GPU (its workers decode), else ``eval_cpu``."""
        gpus = self.features_gpus()
        return gpus * self.cpu_per_gpu if gpus > 0 else cpu_count(self.eval_cpu)

    def job_nccl_env(self) -> dict[str, str]:
        """The multi-node pods' NCCL environment: with EFA, its libfabric settings beneath ``nccl_env``."""
        return {**(EFA_NCCL_ENV if self.efa_devices else {}), **self.nccl_env}

    def job_pod_metadata(self, labels: dict[str, str], annotations: dict[str, str] | None = None
                         ) -> dict[str, dict[str, str]]:
        """A multi-node job pod's metadata: ``labels`` (what selects it) with ``pod_labels``, and ``annotations``
        with ``pod_annotations`` and ``job_pod_annotations`` over them."""
        metadata = {"labels": {**self.pod_labels, **labels}}
        annotations = {**(annotations or {}), **self.pod_annotations, **self.job_pod_annotations}
        if annotations:
            metadata["annotations"] = annotations
        return metadata

    def job_extra_resources(self) -> dict[str, str]:
        """What each multi-node pod asks for beside its GPUs: the RDMA devices and the EFA devices."""
        extra = dict(self.rdma_resources)
        if self.efa_devices:
            extra[EFA_RESOURCE] = str(self.efa_devices)
        return extra

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, text: str) -> ClusterSettings:
        return cls.model_validate_json(text)
