"""Multi-node training through the Kubeflow Training Operator.

A PyTorchJob (Training Operator v1) or a TrainJob (Kubeflow Trainer v2, runtime ``torch-distributed``) whose
pods each run ``cloob train`` under torchrun: both operators set ``PET_NNODES``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which torchrun reads, so one command serves both. Pods share
nothing but object storage: they read the shards from S3, mirror checkpoints there (a restarted pod resumes with
``--resume latest``) and rank 0 publishes the result under the job's work folder, from where the caller fetches
it. The run's parameters travel as an environment variable (they hold no secrets; S3 credentials come from a
Kubernetes secret, by reference).

The caller needs RBAC to create, get, patch and delete the job kind in its namespace: infra/k8s/base/rbac.yaml.

Every create goes with strict field validation: a field the installed CRD lacks is the API server's refusal (HTTP
400), never a silent prune; a refusal (the schema, an admission webhook such as Trainer's validator, RBAC, a
quota) is one permanent line in the server's words (:func:`create_job`, and :mod:`cloob_core.ops.preflight`'s
dry run of the same body before a run).

The watcher survives its API: a status poll that times out, is reset or answers 5xx/429 is retried with backoff
and never ends the job. It deletes the job only on the outcomes that call for it: seen failing, past its deadline
(or its pending or queue deadline), its fields pruned, its pipeline run stopped; not on an API fault and not on a
bug of its own. A stop signal alone is not that: a node drain, an autoscaler's or Karpenter's consolidation and a
spot reclaim of the watcher's small CPU pod all send SIGTERM while the run goes on. So on SIGTERM the watcher asks
the run's Argo Workflow (named by its pod's ``workflows.argoproj.io/workflow`` label, read in the pod's own
namespace, which a ``job_namespace`` may not be), within ``job_stop_grace_s`` of the pod's grace: terminated by
KFP (``spec.activeDeadlineSeconds: 0``) or Argo (``spec.shutdown``), ended, being deleted or gone (once seen) means
stopped, and the job is deleted; under Airflow it asks the task instance and DAG run instead
(:mod:`cloob_core.ops.airflow_run`: marked failed or cleared means stopped); otherwise, or when it cannot tell in
time, the job is left running, the step ends in one line and its next try adopts the job (same name). Later
signals change nothing. A job that a queue holds suspended (Kueue) is queued, not pending: the watcher says where
it stands and waits up to ``job_queue_timeout_s``. The job's owner is that Workflow (same namespace only:
Kubernetes forbids cross-namespace owners; under Airflow it has none), not the watcher pod, so an evicted watcher
does not take the job with it, and deleting the run deletes the job; the run's exit handler (:func:`end_job`;
Airflow's teardown task) deletes a job that is left when the run ends, and the job's own
``activeDeadlineSeconds`` (the job timeout) bounds an orphan's life.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import signal
import threading
import time
from pathlib import Path
from typing import Any

from cloob_core.config import CloobConfig, config_from_mapping
from cloob_core.config.cluster import ClusterSettings
from cloob_core.errors import StageError
from cloob_core.ops import airflow_run, launch

log = logging.getLogger(__name__)

# kind -> (API group, version, plural, Kind)
KINDS = {
    "pytorchjob": ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
    "trainjob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"),
}
SUCCEEDED = {"pytorchjob": "Succeeded", "trainjob": "Complete"}
PARAMS_ENV = "CLOOB_PARAMS"
WORKSPACE = "/workspace"  # an emptyDir in each pod: the image's user may write there, and pods never share it
PART_OF = {"app.kubernetes.io/part-of": "cloob-pipelines", "app.kubernetes.io/component": "train"}
# The S3 secret's keys: the credentials are required (a misspelled secret stops a pod at its start, not a step at
# its first read); the endpoint is optional, since AWS S3 itself has none (MinIO, Ceph and the like do).
CREDENTIAL_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
ENDPOINT_KEY = "AWS_ENDPOINT_URL"
SECRET_KEYS = (*CREDENTIAL_KEYS, ENDPOINT_KEY)
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})  # an API server's answers worth asking again
CREATE_ATTEMPTS = 6  # creating (and deleting) the job: at most this many tries over transient faults
MAX_BACKOFF_S = 300.0
IMAGE_UID = 10001  # the user infra/images/Dockerfile runs as: every pod runs as it, never as root
# Pod Security "restricted": non-root, the runtime's seccomp profile, no privilege escalation, no capabilities.
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True}
# The watcher pod's Argo Workflow, from the downward API (pipelines/pretrain.py sets it): the job's owner, and what
# says whether the pipeline run was stopped.
WORKFLOW_ENV = "CLOOB_WORKFLOW"
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"  # Argo labels every pod of a workflow with its name
WORKFLOW_API = ("argoproj.io", "v1alpha1", "workflows")
ENDED_PHASES = frozenset({"Succeeded", "Failed", "Error"})
# What Karpenter and the cluster autoscaler read as "do not move this pod voluntarily" (consolidation, drift,
# scale-down): on every training pod (a job's, the one-node step's), the job's watcher and the long CPU steps. A
# drain (kubectl drain, a managed node upgrade) ignores them: docs/kubernetes.md, "Disruptions".
DO_NOT_DISRUPT = {"karpenter.sh/do-not-disrupt": "true", "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
BUDGET_API = ("policy", "v1", "poddisruptionbudgets")
# Trainer's torch runtimes: the replicated job of the training nodes and its container, which the job's
# overrides (v2.1) or patches (v2.3) name; and this project's key among a TrainJob's runtimePatches.
# The label each operator puts on a job's pods (the Training Operator's; Trainer's JobSet's), and how many of each
# pod's last log lines a failure copies into the step's log.
POD_JOB_LABEL = {"pytorchjob": "training.kubeflow.org/job-name", "trainjob": "jobset.sigs.k8s.io/jobset-name"}
LOG_LINES = 40
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue admits a job (or a pod) to the LocalQueue it names
TRAINER_JOB = "node"
TRAINER_CONTAINER = "node"
# A runtime patch's owner: Trainer's admission (v2.2 on, plugins/jobset) requires a domain-prefixed path
# (apimachinery's IsDomainPrefixedPath, "acme.io/foo"), as Kueue's "kueue.x-k8s.io/manager".
PATCH_MANAGER = "cloob-pipelines.io/train"
# Every create is sent with the API server's strict field validation: an unknown field is an error (HTTP 400),
# not a field pruned without a word (fieldValidation, GA in Kubernetes 1.27; an older server ignores it, and the
# read-back after create still finds what it dropped).
FIELD_VALIDATION = "Strict"
# The training account the multi-node step talks to the API as (ClusterSettings.job_account), and the step's own pod,
# which its short-lived tokens of that account are bound to (pipelines/pretrain.py sets them from the downward API).
JOB_ACCOUNT_ENV = "CLOOB_JOB_ACCOUNT"
POD_NAME_ENV, POD_UID_ENV = "CLOOB_POD_NAME", "CLOOB_POD_UID"
TOKEN_LIFETIME_S = 3600  # each token's life (the API server's minimum is 10 minutes)
TOKEN_RENEW_S = 600  # a token is renewed once less than this is left
_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class JobFailed(StageError):
    """The training job ended in failure, timed out or was cancelled (it is deleted then). ``permanent``: its pods
    exited with codes 1-127 (the code's own failure: a diverged run, a configuration error), which another try
    of the same run would repeat."""

    permanent = False


def job_name(run_id: str) -> str:
    """A DNS-1035 name (the operators name services after it) unique to the pipeline run."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
    return f"cloob-train-{slug}"[:52].rstrip("-")


def job_config(config: CloobConfig, shards: str, workdir: str, gpus: int = 0,
               metrics_port: int = ClusterSettings.model_fields["metrics_port"].default) -> CloobConfig:
    """The run's configuration as every pod trains with it: the shards where they lie, checkpoints mirrored to
    the job's folder (a restarted pod resumes from there), metrics served on the pods' port
    (``ClusterSettings.metrics_port``); on pods given GPUs, CUDA (:func:`launch.on_gpus`)."""
    return launch.on_gpus(config_from_mapping(config.model_dump(), values={"train": {
        "shards": shards, "checkpoint_sync": f"{workdir}/checkpoints", "metrics_host": "0.0.0.0",
        "metrics_port": metrics_port}}), gpus)


def worker_script(settings: ClusterSettings, workdir: str) -> str:
    """What every pod runs: the validated configuration to its params file, then torchrun around `cloob train`
    (resuming, and publishing the result to the job's folder)."""
    train = launch.torchrun_train(launch.PARAMS_FILE, "run", processes=max(settings.gpus, 1), nodes=settings.nodes,
                                  python="python", extra=["--resume", "latest", "--publish", f"{workdir}/output"])
    return f'set -eu\nprintf "%s" "${PARAMS_ENV}" > {launch.PARAMS_FILE}\nexec {shlex.join(train)}\n'


def _env(settings: ClusterSettings, params_text: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": PARAMS_ENV, "value": params_text},
                                 {"name": "PYTHONUNBUFFERED", "value": "1"},
                                 # the thread budget's cores (cloob_core/threads.py): the pod's CPU request, rounded
                                 # up, not the node's cores (a request sets no cgroup quota to read)
                                 {"name": "LOKY_MAX_CPU_COUNT",
                                  "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1"}}}]
    env += [{"name": key, "value": value} for key, value in sorted(settings.job_nccl_env().items())]
    if settings.s3_secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": settings.s3_secret, "key": key,
                                                             "optional": key == ENDPOINT_KEY}}} for key in SECRET_KEYS]
    return env


def _resources(settings: ClusterSettings) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": str(settings.training_cpus()), "memory": settings.memory}}
    limits = settings.job_extra_resources()
    if settings.gpus > 0:
        limits[settings.accelerator] = str(settings.gpus)
    if limits:
        resources["limits"] = limits
    return resources


def _volumes(settings: ClusterSettings) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm}},
               {"name": "workspace", "emptyDir": {}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "workspace", "mountPath": WORKSPACE}]
    return volumes, mounts


def _placement(settings: ClusterSettings) -> dict[str, Any]:
    """Where and as whom the pods run, in the fields every job API takes (a PyTorchJob's pod template, Trainer
    v2.1's podTemplateOverrides, v2.3's runtimePatches): node selection, the GPU taint, the account, the registry's
    pull secrets."""
    spec: dict[str, Any] = {}
    if settings.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in settings.image_pull_secrets]
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.gpu_tolerations():
        spec["tolerations"] = settings.gpu_tolerations()
    if settings.node_affinity:
        spec["affinity"] = {"nodeAffinity": settings.node_affinity}
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    return spec


def _pod_scheduling(settings: ClusterSettings) -> dict[str, Any]:
    """What only a PyTorchJob's pod template can ask for (ClusterSettings refuses them for a TrainJob, whose
    runtime sets them): the node's network, a priority class, a scheduler."""
    spec: dict[str, Any] = {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"} if settings.host_network \
        else {}
    if settings.priority_class:
        spec["priorityClassName"] = settings.priority_class
    if settings.scheduler_name:
        spec["schedulerName"] = settings.scheduler_name
    return spec


def manifest(settings: ClusterSettings, name: str, config: CloobConfig, workdir: str) -> dict[str, Any]:
    """The PyTorchJob or TrainJob resource for this run; ``config``: what :func:`job_config` gives. Each body holds
    only fields of its operator's CRD (tests/crds holds them, per release); every create is sent with strict field
    validation, so a server refuses any other field rather than prune it."""
    group, version, _, kind = KINDS[settings.job_kind]
    metadata: dict[str, Any] = {"name": name, "labels": {**dict(PART_OF), **(
        {KUEUE_QUEUE_LABEL: settings.kueue_queue} if settings.kueue_queue else {})}}
    if settings.job_namespace:
        metadata["namespace"] = settings.job_namespace
    command = ["/bin/sh", "-c", worker_script(settings, workdir)]
    env = _env(settings, launch.config_text(config))
    if settings.job_kind == "pytorchjob":
        spec = _pytorchjob_spec(settings, command, env)
    else:
        spec = _trainjob_spec(settings, command, env)
    return {"apiVersion": f"{group}/{version}", "kind": kind, "metadata": metadata, "spec": spec}


def _pytorchjob_spec(settings: ClusterSettings, command: list[str], env: list[dict]) -> dict[str, Any]:
    """Training Operator v1: a Master (rank 0, which alone serves metrics) and ``nodes - 1`` Workers. Restarts by
    exit code: 1-127 (a diverged run, a configuration error, any failure of the code) end the job at once, 128 and
    above (a kill: the node's OOM killer, a preemption) restart the pod, which resumes from the last checkpoint."""
    volumes, mounts = _volumes(settings)
    container = {"name": "pytorch", "image": settings.image, "imagePullPolicy": settings.image_pull_policy,
                 "command": command, "workingDir": WORKSPACE,
                 "env": env, "resources": _resources(settings), "volumeMounts": mounts,
                 "securityContext": dict(CONTAINER_SECURITY),
                 "ports": [{"name": "metrics", "containerPort": settings.metrics_port}]}
    template = {"metadata": settings.job_pod_metadata(PART_OF, DO_NOT_DISRUPT),
                "spec": {"containers": [container], "volumes": volumes, "securityContext": dict(POD_SECURITY),
                         **_placement(settings), **_pod_scheduling(settings)}}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "ExitCode", "template": template}}
    if settings.nodes > 1:  # the Workers declare no port to scrape
        worker = json.loads(json.dumps(template))
        del worker["spec"]["containers"][0]["ports"]
        replicas["Worker"] = {"replicas": settings.nodes - 1, "restartPolicy": "ExitCode", "template": worker}
    # an ended job's running pods are stopped (a failed Master's Workers hold GPUs), its ended ones kept with their
    # logs until the job's TTL
    run_policy: dict[str, Any] = {"backoffLimit": settings.job_backoff_limit, "cleanPodPolicy": "Running",
                                  "ttlSecondsAfterFinished": settings.job_ttl_s,
                                  "activeDeadlineSeconds": math.ceil(settings.job_timeout_s)}
    if settings.gang_scheduling:  # all the nodes' pods start together, or none holds a GPU waiting for the rest
        run_policy["schedulingPolicy"] = {"minAvailable": settings.nodes, **(
            {"priorityClass": settings.priority_class} if settings.priority_class else {})}
    return {"nprocPerNode": str(max(settings.gpus, 1)), "runPolicy": run_policy, "pytorchReplicaSpecs": replicas}


def _trainjob_spec(settings: ClusterSettings, command: list[str], env: list[dict]) -> dict[str, Any]:
    """Kubeflow Trainer: the trainer's command, nodes and resources, and the pods' settings in the form the
    cluster's release takes (``trainer_release``). A TrainJob cannot name a container port: the PodMonitor
    cloob-trainjob scrapes rank 0's ``metrics_port`` by number. Its restarts are the runtime's (its JobSet's
    failure policy), not this body's."""
    group, _, _, _ = KINDS["trainjob"]
    volumes, mounts = _volumes(settings)
    spec: dict[str, Any] = {
        "runtimeRef": {"name": settings.job_runtime, "apiGroup": group, "kind": "ClusterTrainingRuntime"},
        "trainer": {"image": settings.image, "command": command, "env": env, "numNodes": settings.nodes,
                    "numProcPerNode": max(settings.gpus, 1), "resourcesPerNode": _resources(settings)}}
    pod = {"volumes": volumes, **_placement(settings)}
    if settings.trainer_release == "v2.1":  # no deadline (the watcher's alone) and no security context
        pod["containers"] = [{"name": TRAINER_CONTAINER, "volumeMounts": mounts}]
        spec["podTemplateOverrides"] = [{"targetJobs": [{"name": TRAINER_JOB}],
                                         "metadata": settings.job_pod_metadata(PART_OF, DO_NOT_DISRUPT),
                                         "spec": pod}]
        return spec
    pod.update(securityContext=dict(POD_SECURITY), containers=[
        {"name": TRAINER_CONTAINER, "volumeMounts": mounts, "securityContext": dict(CONTAINER_SECURITY)}])
    node = {"name": TRAINER_JOB, "template": {"spec": {"template": {
        "metadata": settings.job_pod_metadata(PART_OF, DO_NOT_DISRUPT), "spec": pod}}}}
    spec["activeDeadlineSeconds"] = math.ceil(settings.job_timeout_s)  # the job ends itself then, watched or not
    spec["runtimePatches"] = [{"manager": PATCH_MANAGER,
                               "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node]}}}}]
    return spec


def outcome(kind: str, status: dict[str, Any] | None) -> tuple[str | None, str]:
    """('succeeded' | 'failed' | None while running, the latest condition as text) from a job's status."""
    conditions = [c for c in (status or {}).get("conditions", []) if str(c.get("status")) == "True"]
    for condition in reversed(conditions):
        reason = f"{condition.get('type')}: {condition.get('reason', '')} {condition.get('message', '')}".strip()
        if condition.get("type") == SUCCEEDED[kind]:
            return "succeeded", reason
        if condition.get("type") == "Failed":
            return "failed", reason
    latest = conditions[-1] if conditions else {}
    return None, f"{latest.get('type', 'Pending')}: {latest.get('message', '')}".strip(": ")


def _apis() -> tuple[Any, Any]:
    """The custom-objects and core APIs. In a pod: as the training account (``CLOOB_JOB_ACCOUNT``), with
    short-lived tokens of it requested with the pod's own identity (:class:`TrainingToken`), else as the pod's own
    service account. Elsewhere: the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=_kubeconfig())
    account = os.environ.get(JOB_ACCOUNT_ENV)
    return clients(account if account and _pod_namespace() else None)


def clients(account: str | None = None) -> tuple[Any, Any]:
    """The custom-objects and core APIs of the loaded configuration, without urllib3's own retries: the watcher
    tries again itself, within its deadlines (job_api_timeout_s, a stop signal's grace), which urllib3's hidden
    retries of a read that timed out would multiply. With ``account``, they talk as that service account of the
    pod's namespace (:class:`TrainingToken`)."""
    from kubernetes import client

    configuration = client.Configuration.get_default_copy()
    configuration.retries = False
    if account:
        own = client.Configuration.get_default_copy()  # the pod's own identity asks for the account's tokens
        own.retries = False
        TrainingToken(account, _pod_namespace() or "default", client.CoreV1Api(client.ApiClient(own))).install(
            configuration)
    api_client = client.ApiClient(configuration)
    return client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)


class TrainingToken:
    """Tokens of the training account, requested from the API server (TokenRequest) by the step's own account, each
    valid :data:`TOKEN_LIFETIME_S` and bound to the step's pod (void once the pod is gone), renewed before each call
    once less than :data:`TOKEN_RENEW_S` is left: no long-lived token is stored anywhere, and the account every step
    runs as holds only the right to request these (the Role cloob-training-token), no rights over jobs."""

    def __init__(self, account: str, namespace: str, core: Any) -> None:
        self.account, self.namespace, self.core = account, namespace, core
        self.expires = 0.0

    def install(self, configuration: Any) -> None:
        """The first token into ``configuration``, and the hook that renews it (the client calls it before every
        request); refused in one line naming the Role when the step's account may not request one."""
        try:
            self.refresh(configuration)
        except Exception as err:
            if _status_code(err) == 403:
                raise JobRefused(f"this step's account may not request tokens of the training account "
                                 f"{self.namespace}/{self.account} (HTTP 403): bind the Role cloob-training-token to "
                                 f"it (infra/k8s/base/rbac.yaml): {api_message(err)}", 403, api_message(err)) from None
            raise
        configuration.refresh_api_key_hook = self.refresh

    def refresh(self, configuration: Any) -> None:
        if self.expires - time.time() > TOKEN_RENEW_S:
            return
        spec: dict[str, Any] = {"expirationSeconds": TOKEN_LIFETIME_S}
        pod, uid = os.environ.get(POD_NAME_ENV), os.environ.get(POD_UID_ENV)
        if pod and uid:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}
        answer = self.core.create_namespaced_service_account_token(
            self.account, self.namespace, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                           "spec": spec}, _request_timeout=30)
        configuration.api_key["authorization"] = answer.status.token
        configuration.api_key_prefix["authorization"] = "Bearer"
        self.expires = answer.status.expiration_timestamp.timestamp()
        log.info("talking to the API as %s/%s (a token valid until %s)", self.namespace, self.account,
                 time.strftime("%H:%M:%S UTC", time.gmtime(self.expires)))


def _kubeconfig() -> str | None:
    """KUBECONFIG as it is now (the client reads it once, at import)."""
    return os.environ.get("KUBECONFIG") or None


def _pod_namespace() -> str | None:
    """The namespace of the pod this runs in (its service account's), or None outside a pod."""
    return _NAMESPACE_FILE.read_text().strip() if _NAMESPACE_FILE.is_file() else None


def current_namespace(default: str = "default") -> str:
    """In a pod: its own namespace. Elsewhere: the kubeconfig context's, as kubectl would use."""
    own = _pod_namespace()
    if own is not None:
        return own
    from kubernetes import config

    try:
        _, active = config.list_kube_config_contexts(config_file=_kubeconfig())
    except (config.ConfigException, OSError):
        return default
    return (active or {}).get("context", {}).get("namespace") or default


class _Cancelled(BaseException):  # not an Exception: no handler of an API fault may swallow it
    pass


class _StopSignal:
    """SIGTERM to the watcher. The first one ends the watch (raised as :class:`_Cancelled` while it watches) and
    starts the grace (``job_stop_grace_s``) that every API call from then on fits in; later ones (Argo's and the
    kubelet's repeats) change nothing, so no read or delete is interrupted half way."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self.until: float | None = None
        self.watching = True

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            return
        self.signum, self.until = signum, time.monotonic() + self.grace_s
        if self.watching:
            raise _Cancelled(f"signal {signum}")

    def left(self) -> float | None:
        """Seconds of the grace left, or None before a signal."""
        return None if self.until is None else self.until - time.monotonic()


class _End(Exception):
    """How a watch ends: the step's error, and whether the job goes with it (seen failing, past a deadline, its
    fields pruned, its run stopped) and its pods' evidence is copied first. Nothing else deletes a job: not an API
    fault, not a drain's SIGTERM, not a bug in the watcher."""

    def __init__(self, error: JobFailed, delete: bool, report: bool = False) -> None:
        super().__init__(str(error))
        self.error, self.delete, self.report = error, delete, report


def run(body: dict[str, Any], settings: ClusterSettings, api: Any = None, core: Any = None) -> str:
    """Create the job (or adopt this run's, made by an earlier try of the watcher) and wait for it to end. A job
    seen failing, one past ``job_timeout_s`` (or waiting past its pending or queue deadline) and one whose pipeline
    run was stopped are deleted, so no GPU node stays held by an orphan; API faults, a SIGTERM while the run goes
    on (a drain, an eviction) and anything unexpected are never a reason to delete. Before a failed job is deleted,
    its pods' exit codes, termination messages and last log lines are copied into this step's log (``core``: the
    core API that reads them; none, none are read)."""
    if api is None:
        api, core = _apis()
    return _Watch(body, settings, api, core).run()


class _Watch:
    """One watch of one job: its calls, their deadlines and the stop signal they respect."""

    def __init__(self, body: dict[str, Any], settings: ClusterSettings, api: Any, core: Any) -> None:
        self.group, self.version, self.plural, self.kind = KINDS[settings.job_kind]
        self.body, self.settings, self.api, self.core = body, settings, api, core
        self.namespace = settings.job_namespace or current_namespace()
        self.name = body["metadata"]["name"]
        self.where = f"{self.kind} {self.namespace}/{self.name}"
        self.stop = _StopSignal(settings.job_stop_grace_s)
        self.airflow_task = airflow_run.task_from_env()  # under Airflow: its task instance, not a Workflow
        self.run_stopped = run_stopped if self.airflow_task is None else airflow_run.run_stopped
        self.run_seen = False  # a run that never answered is no proof of a stopped run

    def timeout(self) -> float:
        """An API call's deadline: ``job_api_timeout_s``, within what a stop signal's grace leaves."""
        left = self.stop.left()
        return self.settings.job_api_timeout_s if left is None else max(0.1, min(self.settings.job_api_timeout_s,
                                                                                 left))

    def retried(self, call: Any, what: str) -> Any:
        return _retried(call, what, self.settings, self.stop, self.timeout)

    def run(self) -> str:
        previous = signal.signal(signal.SIGTERM, self.stop) if _main_thread() else None
        try:
            try:
                try:
                    return self._watch()
                except _Cancelled as err:
                    self.stop.watching = False
                    end = self._on_stop(err)
            except _End as ended:
                end = ended
            self.stop.watching = False
            if end.report:  # past its deadline, or waiting too long: what its pods said, if any
                report_pods(self.core, self.namespace, self.name, self.settings, self.timeout)
            if end.delete:
                self._delete()
            raise end.error from None
        finally:
            self.stop.watching = False
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _end(self, error: JobFailed, delete: bool, report: bool = False) -> None:
        self.stop.watching = False  # from here on a signal interrupts nothing
        raise _End(error, delete, report)

    def _watch(self) -> str:
        settings, where = self.settings, self.where
        run, _ = self.read_run()
        self.run_seen = bool(run)
        owner = _workflow_owner(run) if self.airflow_task is None and _pod_namespace() == self.namespace else None
        body = {**self.body, "metadata": {**self.body["metadata"], "ownerReferences": [owner]}} if owner else \
            self.body
        deadline = time.monotonic() + settings.job_timeout_s
        try:
            created = create_job(self.api, body, self.namespace, settings, retried=self.retried)
        except JobFailed as err:
            self._end(err, delete=False)
        if created is not None:
            log.info("created %s: %d node(s) x %d GPU(s)", where, settings.nodes, settings.gpus)
        else:
            log.info("%s exists (an earlier try of this step created it): watching it", where)
            if owner:
                self._add_owner(owner)
        if settings.job_disruption_budget:
            self._budget(created)
        last, faults, checked = "", 0, False
        pending_since: float | None = None
        queued_since: float | None = None
        while True:
            try:
                job = self.api.get_namespaced_custom_object(self.group, self.version, self.namespace, self.plural,
                                                            self.name, _request_timeout=self.timeout())
            except Exception as err:
                if _status_code(err) == 404:
                    self._end(JobFailed(f"{where} no longer exists: it was deleted outside this run"), delete=False)
                if not transient(err):  # it may be running: its activeDeadlineSeconds ends it
                    self._end(JobFailed(f"{where}: the API refused its status ({_describe(err)}); the job is left "
                                        f"to its deadline of {settings.job_timeout_s:.0f} s"), delete=False)
                faults += 1
                wait = _backoff(settings, faults)
                log.warning("%s: status poll failed (%s); the job is left running, asking again in %.0f s",
                            where, _describe(err), wait)
                self._sleep_until(wait, deadline)
                continue
            faults = 0
            if not checked:  # once: what the API server kept of the body (a server that ignored strict validation)
                checked = True
                dropped = missing_fields({"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]},
                                         job)
                if dropped:
                    self._end(JobFailed(f"{where}: the API server dropped {len(dropped)} field(s) the body set "
                                        f"({', '.join(dropped[:3])}{', …' if len(dropped) > 3 else ''}): its "
                                        f"{self.kind} schema lacks them, so the job is deleted. "
                                        f"{schema_hint(settings)}"), delete=True)
            state, text = outcome(settings.job_kind, job.get("status"))
            if state == "succeeded":
                self.stop.watching = False
                return text
            if state == "failed":
                self.stop.watching = False
                codes = report_pods(self.core, self.namespace, self.name, settings, self.timeout)
                failed = JobFailed(f"{where} failed: {text}" + (f"; its pods exited with {sorted(set(codes))}"
                                                                if codes else ""))
                failed.permanent = bool(codes) and all(0 < code < 128 for code in codes)
                if settings.job_keep_failed:
                    log.info("%s is kept for inspection (job_keep_failed): delete it with kubectl -n %s delete "
                             "%s %s", where, self.namespace, self.plural, self.name)
                self._end(failed, delete=not settings.job_keep_failed)
            now = time.monotonic()
            if suspended(settings.job_kind, job):  # queued (Kueue suspends a job until it admits it): not pending
                pending_since = None
                queued_since = queued_since or now
                text = f"Queued: {queue_reason(self.api, self.namespace, job, self.timeout())}"
                if now - queued_since > settings.job_queue_timeout_s:
                    self._end(JobFailed(f"{where} was not admitted in {settings.job_queue_timeout_s:.0f} s "
                                        f"(job_queue_timeout_s): {text[len('Queued: '):]}"), delete=True)
            else:
                queued_since = None
                waiting = pending_reason(self.core, self.namespace, self.name, settings, self.timeout) \
                    if state is None else None
                if waiting is None:
                    pending_since = None
                else:
                    text = f"Pending: {waiting}"
                    pending_since = pending_since or now
                    # admitted by Kueue: its waitForPodsReady requeues a job whose pods do not start
                    if not settings.kueue_queue and now - pending_since > settings.job_pending_timeout_s:
                        self._end(JobFailed(f"{where} did not start in {settings.job_pending_timeout_s:.0f} s "
                                            f"(job_pending_timeout_s): {waiting}"), delete=True, report=True)
            if text != last:
                log.info("%s: %s", where, text)
                last = text
            self._sleep_until(settings.job_poll_s, deadline)

    def _sleep_until(self, seconds: float, deadline: float) -> None:
        if time.monotonic() + seconds > deadline:
            time.sleep(max(0.0, deadline - time.monotonic()))
            self._end(JobFailed(f"{self.where} did not finish in {self.settings.job_timeout_s:.0f} s"), delete=True,
                      report=True)
        time.sleep(seconds)

    def _on_stop(self, err: _Cancelled) -> _End:
        """A stop signal: the job goes only when the run, read within the grace (its Workflow, or under Airflow its
        task instance and DAG run), says it stopped."""
        run, why = self.read_run()
        stopped = self.run_stopped(run, seen=self.run_seen)
        if stopped is not None:
            return _End(JobFailed(f"{self.where} cancelled: the pipeline run {stopped}"), delete=True)
        if run:
            cause = "while its pipeline run goes on (a drain or an eviction)"
        else:
            cause = f"and cannot tell whether its pipeline run was stopped ({why})"
        return _End(JobFailed(f"{self.where}: this watcher got {err} {cause}: the job is left running, and the "
                              "step's next try adopts it"), delete=False)

    def read_run(self) -> tuple[dict[str, Any] | None, str]:
        """The pipeline run as it reads now: its Argo Workflow, or under Airflow its DAG run and task instance
        (``{}``: gone; None, with why, when it cannot be read)."""
        if self.airflow_task is None:
            return self.read_workflow()
        task = airflow_run.describe(self.airflow_task)
        try:
            return self.retried(lambda timeout: airflow_run.read(self.airflow_task, timeout),
                                f"reading Airflow task {task}"), ""
        except Exception as err:
            why = f"Airflow task {task} could not be read: {_describe(err)}"
            log.warning("%s", why)
            return None, why

    def read_workflow(self) -> tuple[dict[str, Any] | None, str]:
        """This pod's Argo Workflow, read in the pod's own namespace (the job's may be another); ``{}`` when it is
        gone; None, with why, when there is none to ask or it cannot be read."""
        name, namespace = os.environ.get(WORKFLOW_ENV), _pod_namespace()
        if not name or namespace is None:
            return None, "no workflow to ask: not a pipeline step's pod"
        group, version, plural = WORKFLOW_API
        try:
            return self.retried(lambda timeout: self.api.get_namespaced_custom_object(
                group, version, namespace, plural, name, _request_timeout=timeout),
                f"reading workflow {name}"), ""
        except Exception as err:
            if _status_code(err) == 404:
                return {}, f"workflow {namespace}/{name} not found"
            why = f"workflow {namespace}/{name} could not be read: {_describe(err)}"
            log.warning("%s", why)
            return None, why

    def _add_owner(self, owner: dict[str, Any]) -> None:
        """The run's Workflow as an owner of an adopted job that lacks it (one created by an earlier version, whose
        owner was its watcher pod): the garbage collector deletes a job once every owner is gone."""
        args = (self.group, self.version, self.namespace, self.plural, self.name)
        try:
            current = self.retried(lambda timeout: self.api.get_namespaced_custom_object(
                *args, _request_timeout=timeout), f"reading {self.name}")
            owners = current.get("metadata", {}).get("ownerReferences", [])
            if any(ref.get("uid") == owner["uid"] for ref in owners):
                return
            self.retried(lambda timeout: self.api.patch_namespaced_custom_object(
                *args, {"metadata": {"ownerReferences": [*owners, owner]}}, _request_timeout=timeout),
                f"adding workflow {owner['name']} as an owner of {self.name}")
        except Exception as err:  # the job keeps its owners and its deadline
            log.warning("could not add workflow %s as an owner of %s: %s", owner["name"], self.where,
                        _describe(err))

    def _budget(self, job: dict[str, Any] | None) -> None:
        """The job's own PodDisruptionBudget (``job_disruption_budget``), owned by the job so that it goes with it;
        an adopted job's is there already. Best effort: the job runs without one rather than not at all."""
        try:
            if job is None:
                job = self.retried(lambda timeout: self.api.get_namespaced_custom_object(
                    self.group, self.version, self.namespace, self.plural, self.name, _request_timeout=timeout),
                    f"reading {self.name}")
            body = disruption_budget(self.settings, job)
            self.retried(lambda timeout: _policy_api(self.api).create_namespaced_pod_disruption_budget(
                self.namespace, body, _request_timeout=timeout, field_validation=FIELD_VALIDATION),
                f"creating the disruption budget of {self.name}")
            log.info("%s: PodDisruptionBudget %s (minAvailable %d): a drain waits for the job", self.where,
                     self.name, self.settings.nodes)
        except Exception as err:
            if _status_code(err) != 409:
                log.warning("%s runs without its PodDisruptionBudget: %s", self.where, _describe(err))

    def _delete(self) -> None:
        try:
            self.retried(lambda timeout: self.api.delete_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, self.name,
                body={"propagationPolicy": "Foreground"}, _request_timeout=timeout), f"deleting {self.name}")
            log.info("deleted %s", self.where)
        except Exception as err:  # reported; the job's failure is the error that matters
            if _status_code(err) != 404:
                log.warning("could not delete %s (its activeDeadlineSeconds, and the run's exit handler when the "
                            "run ends, still end it): %s", self.where, _describe(err))


def disruption_budget(settings: ClusterSettings, job: dict[str, Any]) -> dict[str, Any]:
    """A PodDisruptionBudget for ``job``'s pods alone: an integer ``minAvailable`` of all of them (for pods no
    built-in controller owns, Kubernetes takes only that: docs "Arbitrary Controllers and Selectors"), so a drain
    evicts none while they all run; owned by the job, so the garbage collector deletes it with the job."""
    meta = job["metadata"]
    owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": meta["name"], "uid": meta["uid"],
             "controller": False, "blockOwnerDeletion": False}
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": meta["name"], "labels": dict(PART_OF), "ownerReferences": [owner]},
            "spec": {"minAvailable": settings.nodes,
                     "selector": {"matchLabels": {POD_JOB_LABEL[settings.job_kind]: meta["name"]}}}}


def _policy_api(api: Any) -> Any:
    from kubernetes import client

    return client.PolicyV1Api(api.api_client)


def end_job(settings: ClusterSettings, name: str, api: Any = None) -> str:
    """Delete the run's job ``name`` if it is still there: the run has ended (an exit handler's step), so nothing
    watches it any more. What was done, as a line."""
    group, version, plural, kind = KINDS[settings.job_kind]
    if api is None:
        api, _ = _apis()
    namespace = settings.job_namespace or current_namespace()
    try:
        _retried(lambda timeout: api.delete_namespaced_custom_object(
            group, version, namespace, plural, name, body={"propagationPolicy": "Foreground"},
            _request_timeout=timeout), f"deleting {name}", settings)
    except Exception as err:
        if _status_code(err) == 404:
            return f"{kind} {namespace}/{name}: none left to end"
        raise JobFailed(f"could not delete {kind} {namespace}/{name} at the run's end ({_describe(err)}): its "
                        f"activeDeadlineSeconds ({settings.job_timeout_s:.0f} s) still ends it; delete it with "
                        f"kubectl -n {namespace} delete {plural} {name}") from None
    return f"{kind} {namespace}/{name}: deleted at the run's end (nothing watches it any more)"


def create_job(api: Any, body: dict[str, Any], namespace: str, settings: ClusterSettings, dry_run: bool = False,
               retried: Any = None) -> dict[str, Any] | None:
    """Create the job with strict field validation (``dry_run``: with ``dryRun=All`` too, so admission webhooks
    and the CRD's validation judge it and nothing is kept); the object as the API server stored it (or would), or
    None when it exists already (an earlier try of this step, or a reply lost after the server created it). A
    body the server refuses raises :class:`JobRefused`; faults that outlast the tries, :class:`JobFailed`."""
    group, version, plural, _ = KINDS[settings.job_kind]
    options = {"field_validation": FIELD_VALIDATION, **({"dry_run": "All"} if dry_run else {})}
    call = retried or (lambda call, what: _retried(call, what, settings))
    try:
        return call(lambda timeout: api.create_namespaced_custom_object(
            group, version, namespace, plural, body, _request_timeout=timeout, **options),
            f"creating {body['metadata']['name']}")
    except Exception as err:
        if _status_code(err) == 409 and not dry_run:
            return None
        refused = refusal(err, body, namespace, settings)
        if refused is not None:
            raise refused from None
        if transient(err):
            raise JobFailed(f"could not create {body['kind']} {namespace}/{body['metadata']['name']}: "
                            f"{_describe(err)} (after {CREATE_ATTEMPTS} tries)") from None
        raise


class JobRefused(JobFailed):
    """The API server refused the job's body: its schema (an unknown field under strict validation, a wrong value),
    an admission webhook, RBAC, a quota, or no such API. The same body is refused again, so a retry is in vain.
    ``status`` and ``said``: the HTTP status and the server's own message."""

    permanent = True

    def __init__(self, message: str, status: int, said: str) -> None:
        super().__init__(message)
        self.status, self.said = status, said


REFUSED_STATUS = frozenset({400, 403, 404, 405, 409, 415, 422})


def refusal(err: BaseException, body: dict[str, Any], namespace: str, settings: ClusterSettings) -> JobRefused | None:
    """What the API server said when it refused creating ``body``, as one line naming who refused it (the account's
    RBAC, an admission webhook, the schema), or None for an error that is no refusal."""
    code = _status_code(err)
    if code not in REFUSED_STATUS:
        return None
    what = f"{body['kind']} {namespace}/{body['metadata']['name']}"
    said = api_message(err)
    if code == 403 and " cannot create resource " in said:  # RBAC's wording; a webhook's says "admission webhook"
        message = (f"the API refused creating {what} (HTTP 403): this step's account lacks the Role "
                   "cloob-training-jobs (infra/k8s/base/rbac.yaml, bound to cloob-pipeline, as which the step talks: "
                   f"cluster setting job_account): {said}")
    elif code == 404:
        group, version, plural, _ = KINDS[settings.job_kind]
        message = (f"the cluster has no {plural}.{group}/{version} to create {what} in (HTTP 404: {said}). "
                   f"{schema_hint(settings)}")
    else:
        message = f"the cluster refused {what} (HTTP {code}): {said}"
    return JobRefused(message, code, said)


def api_message(err: BaseException) -> str:
    """The message of the API server's Status in an ApiException's body (a webhook's denial, a validation error),
    on one line; else its reason."""
    body = getattr(err, "body", None)
    try:
        message = json.loads(body).get("message") if body else None
    except (TypeError, ValueError, AttributeError):
        message = None
    text = message or getattr(err, "reason", None) or str(err)
    return " ".join(str(text).split())[:1000]


def suspended(kind: str, job: dict[str, Any]) -> bool:
    """Whether the job is suspended: how Kueue holds a job in its queue until it admits it (a PyTorchJob's
    ``runPolicy.suspend``, a TrainJob's ``suspend``)."""
    spec = job.get("spec") or {}
    return (spec.get("runPolicy") or {}).get("suspend") is True if kind == "pytorchjob" else \
        spec.get("suspend") is True


KUEUE_WORKLOADS = ("kueue.x-k8s.io", "v1beta1", "workloads")  # v1beta1: served by Kueue 0.9 to 0.19
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # Kueue's label on the Workload it made for a job
KUEUE_VISIBILITY = "/apis/visibility.kueue.x-k8s.io/v1beta1/namespaces/{namespace}/localqueues/{queue}/pendingworkloads"


def queue_reason(api: Any, namespace: str, job: dict[str, Any], timeout: float) -> str:
    """Why a suspended job waits: Kueue's Workload for it (its LocalQueue; why no quota is reserved; an eviction)
    and its position in the queue from Kueue's visibility API. Best effort: what cannot be read is left out."""
    meta = job.get("metadata") or {}
    queue = (meta.get("labels") or {}).get(KUEUE_QUEUE_LABEL)
    said: list[str] = []
    try:
        group, version, plural = KUEUE_WORKLOADS
        items = api.list_namespaced_custom_object(group, version, namespace, plural,
                                                  label_selector=f"{KUEUE_JOB_UID_LABEL}={meta.get('uid')}",
                                                  _request_timeout=timeout).get("items", [])
        workload = items[0] if items else None
    except Exception:
        workload = None
    if workload is not None:
        queue = (workload.get("spec") or {}).get("queueName") or queue
        conditions = {c.get("type"): c for c in (workload.get("status") or {}).get("conditions", [])}
        for kind, status in (("Evicted", "True"), ("QuotaReserved", "False")):
            condition = conditions.get(kind)
            if condition and str(condition.get("status")) == status and condition.get("message"):
                said.append(("evicted: " if kind == "Evicted" else "") + " ".join(condition["message"].split()))
    position = None
    if queue and workload is not None:
        try:
            pending = api.api_client.call_api(
                KUEUE_VISIBILITY, "GET", path_params={"namespace": namespace, "queue": queue},
                response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True,
                _request_timeout=timeout)
            name = workload["metadata"]["name"]
            position = next((item for item in pending.get("items", []) if item["metadata"]["name"] == name), None)
        except Exception:
            position = None
    head = f"suspended in Kueue's LocalQueue {queue}" if queue else "suspended (a queue holds it)"
    if position is not None:
        head += f", position {int(position['positionInLocalQueue']) + 1} in it" + (
            f" and {int(position['positionInClusterQueue']) + 1} in its ClusterQueue"
            if "positionInClusterQueue" in position else "")
    return "; ".join([head, *said])


def pod_selector(kind: str, name: str) -> str:
    """The label selector of a job's pods, as its operator labels them."""
    return f"{POD_JOB_LABEL[kind]}={name}"


def pending_reason(core: Any, namespace: str, name: str, settings: ClusterSettings,
                timeout: Any = None) -> str | None:
    """Why the job's pods are not all running yet, or None when they are (or have ended, or there is no core API
    to ask): a container's waiting reason (ImagePullBackOff, CreateContainerConfigError), else the newest
    Warning Event of the job's objects (FailedScheduling: "0/12 nodes are available: 8 Insufficient
    nvidia.com/gpu"; a quota's FailedCreate), else that no pod exists yet. Faults of these reads are no reason."""
    if core is None:
        return None
    deadline = timeout or (lambda: settings.job_api_timeout_s)
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=pod_selector(settings.job_kind, name),
                                        _request_timeout=deadline()).items
    except Exception:
        return None
    waiting = [pod for pod in pods if pod.status.phase == "Pending"]
    if pods and not waiting:
        return None
    for pod in sorted(waiting, key=lambda pod: pod.metadata.name):
        for status in pod.status.container_statuses or []:
            held = status.state and status.state.waiting
            if held and held.reason not in (None, "ContainerCreating", "PodInitializing"):
                return f"pod {pod.metadata.name}: {held.reason}: {' '.join((held.message or '').split())[:300]}"
    try:
        events = core.list_namespaced_event(namespace, _request_timeout=deadline()).items
    except Exception:
        events = []
    own = [event for event in events if event.type == "Warning" and event.involved_object is not None and
           (event.involved_object.name == name or str(event.involved_object.name).startswith(f"{name}-"))]
    if own:
        newest = max(own, key=lambda event: str(event.last_timestamp or event.event_time or ""))
        return f"{newest.involved_object.kind} {newest.involved_object.name}: {newest.reason}: " \
               f"{' '.join((newest.message or '').split())[:300]}"
    return f"{len(waiting)} of {len(pods)} pod(s) pending" if pods else "no pod created yet"


def report_pods(core: Any, namespace: str, name: str, settings: ClusterSettings,
                timeout: Any = None) -> list[int]:
    """Each pod of the job into this step's log: its containers' exit codes, reasons and termination messages,
    and the last :data:`LOG_LINES` lines of its log, so a failure keeps its evidence after the job is deleted;
    the non-zero exit codes. Best effort: a pod or log the API cannot give is said, never an error."""
    if core is None:
        return []
    deadline = timeout or (lambda: settings.job_api_timeout_s)
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=pod_selector(settings.job_kind, name),
                                        _request_timeout=deadline()).items
    except Exception as err:
        log.warning("could not list the pods of %s/%s: %s", namespace, name, _describe(err))
        return []
    codes: list[int] = []
    for pod in sorted(pods, key=lambda pod: pod.metadata.name):
        for status in pod.status.container_statuses or []:
            ended = (status.state and status.state.terminated) or (status.last_state and
                                                                   status.last_state.terminated)
            if ended is None:
                log.info("pod %s, container %s: %s", pod.metadata.name, status.name, pod.status.phase)
            else:
                if ended.exit_code:
                    codes.append(int(ended.exit_code))
                message = " ".join((ended.message or "").split())[-300:]
                log.info("pod %s, container %s: exit code %s (%s)%s, after %d restart(s)", pod.metadata.name,
                         status.name, ended.exit_code, ended.reason, f": {message}" if message else "",
                         status.restart_count or 0)
            try:
                text = core.read_namespaced_pod_log(pod.metadata.name, namespace, container=status.name,
                                                    tail_lines=LOG_LINES, previous=ended is not None and
                                                    not (status.state and status.state.terminated),
                                                    _request_timeout=deadline())
            except Exception as err:
                log.warning("could not read the log of pod %s: %s", pod.metadata.name, _describe(err))
                continue
            for line in (text or "").splitlines()[-LOG_LINES:]:
                log.info("  %s | %s", pod.metadata.name, line)
    return codes


def missing_fields(sent: Any, stored: Any, path: str = "") -> list[str]:
    """The paths of ``sent`` (a body) that ``stored`` (the object as the API server keeps it) lacks: what a
    structural schema pruned. Defaults and fields a webhook adds are no concern; list entries with a ``name`` or
    ``manager`` are matched by it, others by position."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [path or "."]
        dropped = []
        for key, value in sent.items():
            where = f"{path}.{key}" if path else key
            dropped += [where] if key not in stored else missing_fields(value, stored[key], where)
        return dropped
    if isinstance(sent, list) and isinstance(stored, list):
        dropped = []
        for index, item in enumerate(sent):
            key = next((k for k in ("name", "manager") if isinstance(item, dict) and k in item), None)
            if key is not None:
                match = next((s for s in stored if isinstance(s, dict) and s.get(key) == item[key]), None)
                where = f"{path}[{key}={item[key]}]"
            else:
                match = stored[index] if index < len(stored) else None
                where = f"{path}[{index}]"
            dropped += [where] if match is None else missing_fields(item, match, where)
        return dropped
    return []


def schema_hint(settings: ClusterSettings) -> str:
    if settings.job_kind == "trainjob":
        return (f"Is the cluster's Kubeflow Trainer the release trainer_release names ({settings.trainer_release})? "
                "Compile with --trainer-release v2.1, v2.2 or v2.3 (docs/kubernetes.md, \"Versions\").")
    return "Is the cluster's Training Operator v1.8 or later (docs/kubernetes.md, \"Versions\")?"


def transient(err: BaseException) -> bool:
    """A fault of the connection or the API server that asking again may get past: a timeout, a reset or refused
    connection, HTTP 408/429/5xx."""
    code = _status_code(err)
    if code is not None:
        return code in TRANSIENT_STATUS or code == 0  # 0: the client's own connection failure
    module = type(err).__module__.split(".")[0]
    return module == "urllib3" or isinstance(err, (ConnectionError, TimeoutError))


def _status_code(err: BaseException) -> int | None:
    if isinstance(err, airflow_run.AirflowApiError):
        return err.status
    status = getattr(err, "status", None)
    return status if type(err).__name__ == "ApiException" and isinstance(status, int) else None


def _describe(err: BaseException) -> str:
    code = _status_code(err)
    if code:
        return f"HTTP {code} {getattr(err, 'reason', '') or ''}".strip()
    return " ".join(f"{type(err).__name__}: {err}".split())[:200]


def _backoff(settings: ClusterSettings, attempt: int) -> float:
    """Seconds before try ``attempt`` + 1: the poll interval, doubling, at most 5 minutes."""
    return min(settings.job_poll_s * 2 ** (attempt - 1), max(MAX_BACKOFF_S, settings.job_poll_s))


def _retried(call: Any, what: str, settings: ClusterSettings, stop: _StopSignal | None = None,
             timeout: Any = None) -> Any:
    """``call(deadline)``, tried again over transient faults: at most :data:`CREATE_ATTEMPTS` tries and, after a
    stop signal, only while its grace lasts (waits of a second at most then). ``timeout()`` gives each try's
    deadline (default ``job_api_timeout_s``)."""
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        try:
            seconds = timeout() if timeout else settings.job_api_timeout_s
            return call(seconds) if stop is None or stop.until is None else _within(call, seconds)
        except Exception as err:
            left = stop.left() if stop else None
            wait = _backoff(settings, attempt) if left is None else min(1.0, _backoff(settings, attempt))
            if not transient(err) or attempt == CREATE_ATTEMPTS or (left is not None and left < wait + 0.5):
                raise
            log.warning("%s failed (%s); trying again in %.0f s", what, _describe(err), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _within(call: Any, seconds: float) -> Any:
    """``call(seconds)``, given up after ``seconds`` whatever the socket does: a read's timeout is per receive, so
    a server that trickles its answer, or a call that urllib3 retries, would outlast it. For the calls after a stop
    signal, which must end within its grace (the abandoned call ends with the process)."""
    done: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            done.append((True, call(seconds)))
        except BaseException as err:  # handed to the caller
            done.append((False, err))

    worker = threading.Thread(target=target, name="cloob-watcher-call", daemon=True)
    worker.start()
    worker.join(seconds + 0.2)
    if not done:
        raise TimeoutError(f"no answer in {seconds:.1f} s")
    ok, value = done[0]
    if not ok:
        raise value
    return value


def run_stopped(workflow: dict[str, Any] | None, seen: bool = True) -> str | None:
    """How the pipeline run was stopped, from its Workflow as it reads now (``{}``: not found); None while it goes
    on, or when there is no workflow to tell. A Workflow that was never ``seen`` and is not found now is no proof
    of a stopped run (a name that was never right, RBAC that hides it): None."""
    if workflow is None or (not workflow and not seen):
        return None
    if not workflow:
        return "is gone (its workflow was deleted)"
    spec, meta = workflow.get("spec", {}), workflow.get("metadata", {})
    phase = workflow.get("status", {}).get("phase")
    if meta.get("deletionTimestamp"):
        return "is being deleted"
    if spec.get("shutdown"):
        return f"was stopped (workflow spec.shutdown: {spec['shutdown']})"
    if spec.get("activeDeadlineSeconds") == 0:
        return "was terminated (workflow spec.activeDeadlineSeconds: 0, as KFP terminates a run)"
    if phase in ENDED_PHASES:
        return f"has ended (workflow phase {phase})"
    return None


def _workflow_owner(workflow: dict[str, Any] | None) -> dict[str, Any] | None:
    """An owner reference to the run's Workflow: outlives an evicted watcher pod, goes with the run."""
    meta = (workflow or {}).get("metadata", {})
    if not (meta.get("name") and meta.get("uid")):
        return None
    group, version, _ = WORKFLOW_API
    return {"apiVersion": f"{group}/{version}", "kind": "Workflow", "name": meta["name"], "uid": meta["uid"],
            "controller": False, "blockOwnerDeletion": False}


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
