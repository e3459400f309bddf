"""mode kubernetes: each task is its step's pod, the pod the compiled Kubeflow pipeline gives that step for the same
:class:`ClusterSettings` (:func:`cloob_core.ops.pods.pod`, rendered here as KubernetesPodOperator arguments as
``pipelines/pretrain.py`` renders it as kfp-kubernetes calls; tests/test_airflow_pods.py holds the two equal).

What the Kubeflow pipeline's driver does around a pod is done here: the pod waits for its node as long as
``job_pending_timeout_s`` says (the provider's 120 s is shorter than a GPU node's start); the restricted security
context (non-root, no privilege escalation, all capabilities dropped, the runtime's seccomp profile) covers the
XCom sidecar too, which runs the step's own image instead of Docker Hub's alpine (a cluster without Docker Hub
starts it from the node's cache); exit 2 fails the task for good; and a pod that left no record of having finished
is never a success, whatever the provider reports (apache/airflow #73006: a task that got SIGTERM mid-run ends as
a success)."""

from __future__ import annotations

import json
import math
from typing import Any

from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.providers.cncf.kubernetes.utils.xcom_sidecar import PodDefaults
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from kubernetes.client import models as k8s

from cloob_core.config.airflow import AirflowSettings
from cloob_core.ops import airflow_run, pods
from pipelines.airflow_task import PERMANENT_EXIT, StepTask, finished_result

COMMAND = ["python", "-m", "cloob_core.ops.task_runner"]  # the images' PATH leads to their venv
RESULT = f"{PodDefaults.XCOM_MOUNT_PATH}/return.json"  # what the provider reads back as the task's XCom
SHM_VOLUME, SPILL_VOLUME = "dshm", "spill"  # the names pipelines/pretrain.py gives them


def images(settings: AirflowSettings) -> dict[str, str]:
    """The CPU and CUDA images, as the compiled Kubeflow pipeline names them unless the settings say otherwise."""
    from components.images import CPU_IMAGE, CUDA_IMAGE

    return {"cpu": settings.cpu_image or CPU_IMAGE, "cuda": settings.cuda_image or CUDA_IMAGE}


def restricted(run_as: int) -> k8s.V1SecurityContext:
    """A container's part of Pod Security's "restricted" profile."""
    return k8s.V1SecurityContext(allow_privilege_escalation=False, capabilities=k8s.V1Capabilities(drop=["ALL"]),
                                 run_as_non_root=True, run_as_user=run_as, run_as_group=run_as,
                                 seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"))


def _env(pod: pods.Pod) -> list[k8s.V1EnvVar]:
    """The step's variables, the downward API's fields, and the S3 secret's keys under their own names."""
    env = [k8s.V1EnvVar(name=name, value=value) for name, value in pod.env.items()]
    env += [k8s.V1EnvVar(name=name, value_from=k8s.V1EnvVarSource(field_ref=k8s.V1ObjectFieldSelector(
        field_path=path))) for name, path in pod.field_env.items()]
    env += [k8s.V1EnvVar(name=key, value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(
        name=secret.secret, key=key, optional=secret.optional))) for secret in pod.secret_env for key in secret.keys]
    return env


# The task instance the multi-node watcher asks about after a SIGTERM (ops/airflow_run.py), rendered when the task
# runs; under Kubeflow the pod names its Argo Workflow instead (pipelines/pretrain.py).
TASK_TEMPLATE = ('{{ {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id, "map_index": ti.map_index}'
                 ' | tojson }}')


def _run_state_env(settings: AirflowSettings) -> list[k8s.V1EnvVar]:
    """The watcher's way to its Airflow run: the task instance, the API server, its credentials (either keys)."""
    env = [k8s.V1EnvVar(name=airflow_run.TASK_ENV, value=TASK_TEMPLATE)]
    if settings.api_url:
        env.append(k8s.V1EnvVar(name=airflow_run.API_ENV, value=settings.api_url))
        env += [k8s.V1EnvVar(name=key, value_from=k8s.V1EnvVarSource(secret_key_ref=k8s.V1SecretKeySelector(
            name=settings.api_secret, key=key, optional=True))) for key in airflow_run.SECRET_KEYS]
    return env


def _volumes(pod: pods.Pod) -> tuple[list[k8s.V1Volume], list[k8s.V1VolumeMount]]:
    """A memory-backed /dev/shm for data-loader workers; a generic ephemeral volume for a step that spills."""
    volumes, mounts = [], []
    if pod.shm:
        volumes.append(k8s.V1Volume(name=SHM_VOLUME, empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory",
                                                                                          size_limit=pod.shm)))
        mounts.append(k8s.V1VolumeMount(name=SHM_VOLUME, mount_path=pods.SHM_PATH))
    if pod.spill:
        claim = k8s.V1PersistentVolumeClaimSpec(access_modes=["ReadWriteOnce"],
                                                resources=k8s.V1VolumeResourceRequirements(
                                                    requests={"storage": pod.spill}))
        volumes.append(k8s.V1Volume(name=SPILL_VOLUME, ephemeral=k8s.V1EphemeralVolumeSource(
            volume_claim_template=k8s.V1PersistentVolumeClaimTemplate(spec=claim))))
        mounts.append(k8s.V1VolumeMount(name=SPILL_VOLUME, mount_path=pods.SPILL_PATH))
    return volumes, mounts


def pod_arguments(step: str, settings: AirflowSettings) -> dict[str, Any]:
    """The KubernetesPodOperator arguments of ``step``'s pod for ``settings`` (its command's arguments, the step's
    inputs, are set when the task runs)."""
    pod = pods.pod(step, settings.cluster)
    limits = {**({"memory": pod.memory_limit} if pod.memory_limit else {}),
              **({pod.accelerator: str(pod.gpus)} if pod.gpus and pod.accelerator else {})}
    volumes, mounts = _volumes(pod)
    waits = math.ceil(settings.cluster.job_pending_timeout_s)  # for a node, an image pull, a quota
    in_cluster = settings.kubernetes_conn_id is None
    return {
        "name": f"cloob-{step.replace('_', '-')}", "namespace": settings.namespace,
        "kubernetes_conn_id": settings.kubernetes_conn_id, "in_cluster": in_cluster,
        "service_account_name": settings.service_account,
        "image": images(settings)[pod.image], "image_pull_policy": pod.image_pull_policy,
        "image_pull_secrets": [k8s.V1LocalObjectReference(name=name) for name in pod.image_pull_secrets] or None,
        "cmds": list(COMMAND),
        "env_vars": _env(pod) + (_run_state_env(settings) if step == "train_multinode" else []),
        "container_resources": k8s.V1ResourceRequirements(requests={"cpu": pod.cpu, "memory": pod.memory},
                                                          limits=limits or None),
        "node_selector": dict(pod.node_selector) or None,
        "tolerations": [dict(toleration) for toleration in pod.tolerations] or None,
        "affinity": {"nodeAffinity": dict(pod.node_affinity)} if pod.node_affinity else None,
        "labels": dict(pod.labels), "annotations": dict(pod.annotations) or None,
        "volumes": volumes, "volume_mounts": mounts,
        "security_context": k8s.V1PodSecurityContext(run_as_user=pod.run_as, run_as_group=pod.run_as,
                                                     run_as_non_root=True,
                                                     seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault")),
        "container_security_context": restricted(pod.run_as),
        "xcom_sidecar_container_security_context": restricted(pod.run_as),
        "active_deadline_seconds": pod.timeout_s,
        "startup_timeout_seconds": waits, "schedule_timeout_seconds": waits,
        "termination_message_policy": "FallbackToLogsOnError",  # the step's last line, the reason of a failure
        "do_xcom_push": True, "get_logs": True, "on_finish_action": "delete_pod",
    }


def _terminated(pod: k8s.V1Pod | None, container: str) -> k8s.V1ContainerStateTerminated | None:
    statuses = (pod.status.container_statuses if pod is not None and pod.status else None) or []
    status = next((status for status in statuses if status.name == container), None)
    return status.state.terminated if status is not None and status.state else None


class PodStep(StepTask, KubernetesPodOperator):
    """The step as its pod: ``python -m cloob_core.ops.task_runner STEP`` with the step's inputs, its record of
    having finished read back through the XCom sidecar."""

    template_fields = (*KubernetesPodOperator.template_fields, *StepTask.template_fields)
    ui_color = "#cfe2f3"

    def execute(self, context: Any) -> Any:
        inputs, output = self._resolved(context)
        self.arguments = [self.step, "--inputs", json.dumps(inputs), "--output", output, "--result", RESULT]
        return finished_result(self.step, super().execute(context))

    def build_pod_request_obj(self, context: Any = None, *, dry_run: bool = False) -> k8s.V1Pod:
        made = super().build_pod_request_obj(context, dry_run=dry_run)
        for container in made.spec.containers:
            if container.name == PodDefaults.SIDECAR_CONTAINER_NAME:  # the node has the step's image already
                container.image, container.image_pull_policy = self.image, self.image_pull_policy
        return made

    def cleanup(self, pod: k8s.V1Pod, remote_pod: k8s.V1Pod, xcom_result: dict | None = None,
                context: Any = None) -> None:
        ended = _terminated(remote_pod, self.base_container_name)
        try:
            super().cleanup(pod, remote_pod, xcom_result, context)
        except AirflowException as err:
            if ended is not None and ended.exit_code == PERMANENT_EXIT:  # a user's error: no retry changes it
                last = next((line for line in reversed((ended.message or "").splitlines()) if line.strip()), "")
                raise AirflowFailException(last or f"step {self.step} exited {PERMANENT_EXIT}") from err
            raise
