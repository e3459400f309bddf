"""Multi-node training through the Kubeflow Training Operator.

A PyTorchJob (Training Operator v1) or a TrainJob (Kubeflow Trainer v2, runtime ``torch-distributed``) whose
pods each run ``cloob train`` under torchrun: both operators set ``PET_NNODES``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which torchrun reads, so one command serves both. Pods share
nothing but object storage: they read the shards from S3, mirror checkpoints there (a restarted pod resumes with
``--resume latest``) and rank 0 publishes the result under the job's work folder, from where the caller fetches
it. The run's parameters travel as an environment variable (they hold no secrets; S3 credentials come from a
Kubernetes secret, by reference).

The caller needs RBAC to create, get, patch and delete the job kind in its namespace: infra/k8s/base/rbac.yaml.

The watcher survives its API: a status poll that times out, is reset or answers 5xx/429 is retried with backoff
and never ends the job. It deletes the job only when it saw it fail, when the job's time is up, or when the
pipeline run itself was stopped. A stop signal alone is not that: a node drain, an autoscaler's or Karpenter's
consolidation and a spot reclaim of the watcher's small CPU pod all send SIGTERM while the run goes on. So on
SIGTERM the watcher asks the run's Argo Workflow (named by its pod's ``workflows.argoproj.io/workflow`` label):
terminated by KFP (``spec.activeDeadlineSeconds: 0``) or Argo (``spec.shutdown``), ended, being deleted or gone
means stopped, and the job is deleted; otherwise, or when it cannot tell, the job is left running and the step's
next try adopts it (same name). The job's owner is that Workflow (same namespace only: Kubernetes forbids
cross-namespace owners), not the watcher pod, so an evicted watcher does not take the job with it, and deleting
the run deletes the job; the job's own ``activeDeadlineSeconds`` (the job timeout) bounds an orphan's life.
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
from cloob_core.ops import launch

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
# The watcher pod is not to be evicted by Karpenter's or the cluster autoscaler's consolidation: moving it only
# costs a retry, but each retry is one of the step's few.
WATCHER_ANNOTATIONS = {"karpenter.sh/do-not-disrupt": "true", "cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
# Trainer's torch runtimes: the replicated job of the training nodes and its container, which the job's
# overrides (v2.1) or patches (v2.3) name; and this project's key among a TrainJob's runtimePatches.
# The label each operator puts on a job's pods (the Training Operator's; Trainer's JobSet's), and how many of each
# pod's last log lines a failure copies into the step's log.
POD_JOB_LABEL = {"pytorchjob": "training.kubeflow.org/job-name", "trainjob": "jobset.sigs.k8s.io/jobset-name"}
LOG_LINES = 40
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue admits a job (or a pod) to the LocalQueue it names
TRAINER_JOB = "node"
TRAINER_CONTAINER = "node"
PATCH_MANAGER = "cloob-pipelines"
# Where the multi-node step mounts the training account's token secret (ClusterSettings.job_token_secret).
TOKEN_MOUNT = Path("/var/run/secrets/cloob-training")
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
    only fields of its API's schema (infra/training/crd_schemas.yaml): an API server prunes any other in silence."""
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
    template = {"metadata": settings.job_pod_metadata(PART_OF),
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
                                         "metadata": settings.job_pod_metadata(PART_OF), "spec": pod}]
        return spec
    pod.update(securityContext=dict(POD_SECURITY), containers=[
        {"name": TRAINER_CONTAINER, "volumeMounts": mounts, "securityContext": dict(CONTAINER_SECURITY)}])
    node = {"name": TRAINER_JOB, "template": {"spec": {"template": {"metadata": settings.job_pod_metadata(PART_OF),
                                                                    "spec": pod}}}}
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
    """The custom-objects and core APIs. In a pod: the training account's token where the step mounts it
    (:data:`TOKEN_MOUNT`), else the pod's own service account. Elsewhere: the kubeconfig (KUBECONFIG or
    ~/.kube/config)."""
    from kubernetes import client, config
    from kubernetes.config.incluster_config import InClusterConfigLoader

    try:
        if (TOKEN_MOUNT / "token").is_file():
            InClusterConfigLoader(token_filename=str(TOKEN_MOUNT / "token"),
                                  cert_filename=str(TOKEN_MOUNT / "ca.crt")).load_and_set()
        else:
            config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=_kubeconfig())
    return client.CustomObjectsApi(), client.CoreV1Api()


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


def _raise_cancelled(signum: int, _frame: Any) -> None:
    raise _Cancelled(f"signal {signum}")


def run(body: dict[str, Any], settings: ClusterSettings, api: Any = None, core: Any = None) -> str:
    """Create the job (or adopt this run's, made by an earlier try of the watcher) and wait for it to end. A job
    seen failing, one past ``job_timeout_s`` and one whose pipeline run was stopped are deleted, so no GPU node
    stays held by an orphan; API faults and a SIGTERM while the run goes on (a drain, an eviction) are never a
    reason to delete. Before a failed job is deleted, its pods' exit codes, termination messages and last log
    lines are copied into this step's log (``core``: the core API that reads them; none, none are read)."""
    group, version, plural, kind = KINDS[settings.job_kind]
    if api is None:
        api, core = _apis()
    namespace = settings.job_namespace or current_namespace()
    name = body["metadata"]["name"]
    where = f"{kind} {namespace}/{name}"
    timeout = settings.job_api_timeout_s
    owner = _workflow_owner(_workflow(api, namespace, settings))
    if owner:
        body = {**body, "metadata": {**body["metadata"], "ownerReferences": [owner]}}
    previous = signal.signal(signal.SIGTERM, _raise_cancelled) if _main_thread() else None
    delete = True  # unless the job ended by itself, or is not ours to end
    reported = False  # its pods' evidence in this step's log
    deadline = time.monotonic() + settings.job_timeout_s
    try:
        if _create(api, (group, version, namespace, plural), body, settings):
            log.info("created %s: %d node(s) x %d GPU(s)", where, settings.nodes, settings.gpus)
        else:
            log.info("%s exists (an earlier try of this step created it): watching it", where)
            if owner:
                _add_owner(api, (group, version, namespace, plural, name), owner, settings)
        last, faults, checked, pending_since = "", 0, False, None
        while True:
            try:
                job = api.get_namespaced_custom_object(group, version, namespace, plural, name,
                                                       _request_timeout=timeout)
            except Exception as err:
                if _status_code(err) == 404:
                    delete = False
                    raise JobFailed(f"{where} no longer exists: it was deleted outside this run") from None
                if not transient(err):
                    delete = False  # it may be running: its activeDeadlineSeconds ends it
                    raise JobFailed(f"{where}: the API refused its status ({_describe(err)}); the job is left "
                                    f"to its deadline of {settings.job_timeout_s:.0f} s") from None
                faults += 1
                wait = _backoff(settings, faults)
                log.warning("%s: status poll failed (%s); the job is left running, asking again in %.0f s",
                            where, _describe(err), wait)
                _sleep_until(wait, deadline, settings, where)
                continue
            faults = 0
            if not checked:  # once: what the API server kept of the body
                checked = True
                dropped = missing_fields({"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]},
                                         job)
                if dropped:
                    raise JobFailed(f"{where}: the API server dropped {len(dropped)} field(s) the body set "
                                    f"({', '.join(dropped[:3])}{', …' if len(dropped) > 3 else ''}): its {kind} "
                                    f"schema lacks them, so the job is deleted. {_schema_hint(settings)}")
            status = job.get("status")
            state, text = outcome(settings.job_kind, status)
            waiting = pending_reason(core, namespace, name, settings) if state is None else None
            if waiting is None:
                pending_since = None
            else:
                text = f"Pending: {waiting}"
                pending_since = pending_since or time.monotonic()
                if time.monotonic() - pending_since > settings.job_pending_timeout_s:
                    raise JobFailed(f"{where} did not start in {settings.job_pending_timeout_s:.0f} s "
                                    f"(job_pending_timeout_s): {waiting}")
            if text != last:
                log.info("%s: %s", where, text)
                last = text
            if state == "succeeded":
                delete = False
                return text
            if state == "failed":
                codes, reported = report_pods(core, namespace, name, settings), True
                failed = JobFailed(f"{where} failed: {text}" + (f"; its pods exited with {sorted(set(codes))}"
                                                                if codes else ""))
                failed.permanent = bool(codes) and all(0 < code < 128 for code in codes)
                delete = not settings.job_keep_failed
                if not delete:
                    log.info("%s is kept for inspection (job_keep_failed): delete it with kubectl -n %s delete "
                             "%s %s", where, namespace, plural, name)
                raise failed
            _sleep_until(settings.job_poll_s, deadline, settings, where)
    except _Cancelled as err:
        stopped = run_stopped(_workflow(api, namespace, settings))
        if stopped is None:
            delete = False
            raise JobFailed(f"{where}: this watcher got {err} while its pipeline run goes on (a drain or an "
                            "eviction, or a run this watcher cannot see): the job is left running, and the "
                            "step's next try adopts it") from None
        raise JobFailed(f"{where} cancelled: the pipeline run {stopped}") from None
    except JobFailed:
        if delete and not reported:  # past its deadline, or its fields pruned: what its pods said, if any
            report_pods(core, namespace, name, settings)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if delete:
            _delete(api, (group, version, namespace, plural, name), settings)


def pod_selector(kind: str, name: str) -> str:
    """The label selector of a job's pods, as its operator labels them."""
    return f"{POD_JOB_LABEL[kind]}={name}"


def pending_reason(core: Any, namespace: str, name: str, settings: ClusterSettings) -> str | None:
    """Why the job's pods are not all running yet, or None when they are (or have ended, or there is no core API
    to ask): a container's waiting reason (ImagePullBackOff, CreateContainerConfigError), else the newest
    Warning Event of the job's objects (FailedScheduling: "0/12 nodes are available: 8 Insufficient
    nvidia.com/gpu"; a quota's FailedCreate), else that no pod exists yet. Faults of these reads are no reason."""
    if core is None:
        return None
    timeout = settings.job_api_timeout_s
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=pod_selector(settings.job_kind, name),
                                        _request_timeout=timeout).items
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
        events = core.list_namespaced_event(namespace, _request_timeout=timeout).items
    except Exception:
        events = []
    own = [event for event in events if event.type == "Warning" and event.involved_object is not None and
           (event.involved_object.name == name or str(event.involved_object.name).startswith(f"{name}-"))]
    if own:
        newest = max(own, key=lambda event: str(event.last_timestamp or event.event_time or ""))
        return f"{newest.involved_object.kind} {newest.involved_object.name}: {newest.reason}: " \
               f"{' '.join((newest.message or '').split())[:300]}"
    return f"{len(waiting)} of {len(pods)} pod(s) pending" if pods else "no pod created yet"


def report_pods(core: Any, namespace: str, name: str, settings: ClusterSettings) -> list[int]:
    """Each pod of the job into this step's log: its containers' exit codes, reasons and termination messages,
    and the last :data:`LOG_LINES` lines of its log, so a failure keeps its evidence after the job is deleted;
    the non-zero exit codes. Best effort: a pod or log the API cannot give is said, never an error."""
    if core is None:
        return []
    timeout = settings.job_api_timeout_s
    try:
        pods = core.list_namespaced_pod(namespace, label_selector=pod_selector(settings.job_kind, name),
                                        _request_timeout=timeout).items
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
                                                    _request_timeout=timeout)
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


def _schema_hint(settings: ClusterSettings) -> str:
    if settings.job_kind == "trainjob":
        return (f"Is the cluster's Kubeflow Trainer the release trainer_release names ({settings.trainer_release})? "
                "Compile with --trainer-release v2.1 or v2.3 (docs/kubernetes.md, \"Versions\").")
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


def _sleep_until(seconds: float, deadline: float, settings: ClusterSettings, where: str) -> None:
    if time.monotonic() + seconds > deadline:
        time.sleep(max(0.0, deadline - time.monotonic()))
        raise JobFailed(f"{where} did not finish in {settings.job_timeout_s:.0f} s")
    time.sleep(seconds)


def _retried(call: Any, what: str, settings: ClusterSettings) -> Any:
    """``call()``, tried again over transient faults (at most :data:`CREATE_ATTEMPTS` tries)."""
    for attempt in range(1, CREATE_ATTEMPTS + 1):
        try:
            return call()
        except Exception as err:
            if not transient(err) or attempt == CREATE_ATTEMPTS:
                raise
            wait = _backoff(settings, attempt)
            log.warning("%s failed (%s); trying again in %.0f s", what, _describe(err), wait)
            time.sleep(wait)
    raise AssertionError("unreachable")


def _create(api: Any, where: tuple[str, str, str, str], body: dict[str, Any], settings: ClusterSettings) -> bool:
    """Create the job; False when it exists already (an earlier try of this step, or a reply lost after the API
    server created it)."""
    group, version, namespace, plural = where
    try:
        _retried(lambda: api.create_namespaced_custom_object(group, version, namespace, plural, body,
                                                             _request_timeout=settings.job_api_timeout_s),
                 f"creating {body['metadata']['name']}", settings)
    except Exception as err:
        if _status_code(err) == 409:
            return False
        if _status_code(err) == 403:
            raise JobFailed(f"the API refused creating {body['kind']} {namespace}/{body['metadata']['name']} (HTTP "
                            "403): this step's account lacks the Role cloob-training-jobs (infra/k8s/base/rbac.yaml, "
                            "bound to cloob-pipeline, whose token the step mounts: cluster setting "
                            "job_token_secret)") from None
        raise
    return True


def _workflow(api: Any, namespace: str, settings: ClusterSettings) -> dict[str, Any] | None:
    """This pod's Argo Workflow, as the API server has it; ``{}`` when it is gone; None when there is none to ask
    (no workflow named, another namespace) or it cannot be read."""
    name = os.environ.get(WORKFLOW_ENV)
    if not name or _pod_namespace() != namespace:
        return None
    group, version, plural = WORKFLOW_API
    try:
        return _retried(lambda: api.get_namespaced_custom_object(group, version, namespace, plural, name,
                                                                 _request_timeout=settings.job_api_timeout_s),
                        f"reading workflow {name}", settings)
    except Exception as err:
        if _status_code(err) == 404:
            return {}
        log.warning("could not read this run's workflow %s/%s: %s", namespace, name, _describe(err))
        return None


def run_stopped(workflow: dict[str, Any] | None) -> str | None:
    """How the pipeline run was stopped, from its Workflow (:func:`_workflow`); None while it goes on, or when
    there is no workflow to tell."""
    if workflow is None:
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


def _add_owner(api: Any, where: tuple[str, str, str, str, str], owner: dict[str, Any],
               settings: ClusterSettings) -> None:
    """The run's Workflow as an owner of an adopted job that lacks it (one created by an earlier version, whose
    owner was its watcher pod): the garbage collector deletes a job once every owner is gone."""
    group, version, namespace, plural, name = where
    try:
        current = _retried(lambda: api.get_namespaced_custom_object(group, version, namespace, plural, name,
                                                                    _request_timeout=settings.job_api_timeout_s),
                           f"reading {name}", settings)
        owners = current.get("metadata", {}).get("ownerReferences", [])
        if any(ref.get("uid") == owner["uid"] for ref in owners):
            return
        _retried(lambda: api.patch_namespaced_custom_object(
            group, version, namespace, plural, name, {"metadata": {"ownerReferences": [*owners, owner]}},
            _request_timeout=settings.job_api_timeout_s), f"adding workflow {owner['name']} as an owner of {name}",
            settings)
    except Exception as err:  # the job keeps its owners and its deadline
        log.warning("could not add workflow %s as an owner of %s/%s: %s", owner["name"], namespace, name,
                    _describe(err))


def _delete(api: Any, where: tuple[str, str, str, str, str], settings: ClusterSettings) -> None:
    group, version, namespace, plural, name = where
    try:
        _retried(lambda: api.delete_namespaced_custom_object(group, version, namespace, plural, name,
                                                             body={"propagationPolicy": "Foreground"},
                                                             _request_timeout=settings.job_api_timeout_s),
                 f"deleting {name}", settings)
        log.info("deleted %s/%s", namespace, name)
    except Exception as err:  # reported; the job's failure is the error that matters
        if _status_code(err) != 404:
            log.warning("could not delete %s/%s (its activeDeadlineSeconds still ends it): %s", namespace, name,
                        _describe(err))


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
