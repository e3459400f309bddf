"""The pretraining-and-evaluation pipeline: acquire -> manifest gate -> download fanned out over partitions ->
merge -> shard gate -> train on GPU nodes -> the evaluation suite fanned out over data set x task -> report ->
promotion. The stages are the DVC pipeline's, run by the components in components/steps.py."""

# No `from __future__ import annotations`: KFP reads the pipeline parameter types from the live annotations.

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import yaml
from kfp import dsl, kubernetes

from cloob_core.config.cluster import MAX_DOWNLOAD_GROUPS, ClusterSettings, cpu_count
from cloob_core.ops.kubeflow import SPILL_ENV
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
    WORKFLOW_ENV,
    WORKFLOW_LABEL,
)
from components import steps
from components.images import CUDA_IMAGE

# The repository's params.yaml as the run parameter's default, as one line of JSON (JSON is YAML): a multi-line
# default breaks the comment header the compiler writes, and a struct parameter cannot hold nulls.
DEFAULT_PARAMS = json.dumps(yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text("utf-8")))


def on_cluster(task: dsl.PipelineTask, settings: ClusterSettings, s3: bool = True,
               cpu: bool = True) -> dsl.PipelineTask:
    """What every step's pod gets: the image's non-root user (a namespace under Pod Security "restricted" admits it;
    the compiler adds no privilege escalation, all capabilities dropped and the runtime's seccomp profile), the
    settings' pod labels and annotations, the registry's pull secrets, and with ``s3`` the S3 credentials (and
    endpoint, for MinIO) from the Kubernetes secret as environment variables: never as pipeline parameters, so they
    stay out of the run's recorded inputs. The secret is required: a misspelled name stops the pod at its start,
    not a step at its first read. A ``cpu`` step goes to the CPU steps' nodes (``cpu_node_selector``,
    ``cpu_tolerations``); a GPU step is placed by :func:`on_training_nodes`."""
    kubernetes.set_security_context(task, run_as_user=IMAGE_UID, run_as_group=IMAGE_UID, run_as_non_root=True)
    kubernetes.set_image_pull_policy(task, settings.image_pull_policy)
    if cpu:
        for key, value in settings.cpu_node_selector.items():
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        if settings.cpu_tolerations:
            kubernetes.add_toleration_json(task, list(settings.cpu_tolerations))
    for key, value in settings.pod_labels.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    for key, value in settings.pod_annotations.items():
        kubernetes.add_pod_annotation(task, annotation_key=key, annotation_value=value)
    if settings.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(settings.image_pull_secrets))
    if s3 and settings.s3_secret:
        kubernetes.use_secret_as_env(task, secret_name=settings.s3_secret, optional=False,
                                     secret_key_to_env={key: key for key in CREDENTIAL_KEYS})
        kubernetes.use_secret_as_env(task, secret_name=settings.s3_secret, optional=True,  # none on AWS S3
                                     secret_key_to_env={ENDPOINT_KEY: ENDPOINT_KEY})
    return task


def build(settings: ClusterSettings | None = None):
    """The pipeline function for these cluster settings (fixed at compile time: resources and scheduling are part
    of the pod spec, not run parameters). ``nodes`` > 1 trains through the Training Operator (``job_kind``
    pytorchjob or trainjob, pods sharing ``job_workdir``). ``data``: ``acquire`` builds the shards in
    ``shards_store`` (acquire -> gate -> download fan-out -> merge); ``import`` takes shards already on S3 (e.g.
    a DVC worktree remote) by their URI. Either way the shards reach the gate and training as a location, not
    an artifact, so no pod copies them."""
    settings = settings or ClusterSettings()
    if settings.nodes > 1 and not settings.image:
        settings = settings.model_copy(update={"image": CUDA_IMAGE})

    def train_and_promote(params: str, shards: Any) -> None:
        if settings.curation:
            shards = curated(params, shards, settings)
        shard_gate = long_step(data_step(steps.validate_shards(params=params, shards=shards), settings))
        # the shards' folder keeps its name as a crawl grows: a cache hit would skip the last check before GPU hours
        shard_gate.set_caching_options(False)
        trained = train_task(params, shards, settings)
        trained.after(shard_gate)
        trained.set_caching_options(False)  # a retraining run must train, even on unchanged inputs
        on_cluster(trained, settings, cpu=settings.nodes > 1)  # the multi-node job's watcher is a CPU pod
        reported = evaluate_and_report(params, trained.outputs["model"], settings)
        gate = small(steps.promote(params=params, model=trained.outputs["model"], report=reported.outputs["folder"]))
        gate.set_caching_options(False)  # production may have moved since a cached decision
        on_cluster(gate, settings)

    def acquire_train_and_promote(params: str) -> None:
        acquired = spilling(long_step(data_step(steps.acquire(params=params, store=settings.shards_store),
                                                settings)), settings)
        acquired.set_caching_options(False)  # the source (a URL or bucket) can change under the same name
        # The shards' folder; the partitions read it from the manifest's metadata instead (kfp.local 2.17 hands a
        # ParallelFor body the loop item in place of any task-output parameter passed into it).
        shards = acquired.outputs["Output"]
        gate = spilling(long_step(data_step(steps.validate_manifest(params=params,
                                                                    manifest=acquired.outputs["manifest"]),
                                            settings)), settings)
        gate.set_caching_options(False)  # a gate checks what is there now, never a cached verdict on older data
        # the loop's items are planned at run time from the manifest's index: at most 256 contiguous ranges of
        # shards, so Argo's node status stays far below etcd's object limit whatever the data (docs/kubernetes.md)
        planned = on_cluster(small(steps.plan_download(params=params, manifest=acquired.outputs["manifest"],
                                                       most=min(settings.partitions, MAX_DOWNLOAD_GROUPS))), settings)
        planned.after(gate)
        planned.set_caching_options(False)
        with dsl.ParallelFor(items=planned.output,
                             parallelism=min(settings.download_parallelism, settings.partitions)) as part:
            downloaded = steps.download_partition(params=params, manifest=acquired.outputs["manifest"],
                                                  partition=part)
            downloaded.after(gate)
            downloaded.set_retry(num_retries=3, backoff_duration="60s", backoff_factor=2)
            downloaded.set_caching_options(False)  # it resumes: finished shards in the folder are skipped
            # its memory is bounded (docs/scale.md), so limited: a leak or a runaway worker ends this pod alone
            sized(downloaded, settings.download_cpu, settings.download_memory)
            downloaded.set_memory_limit(settings.download_memory)
            on_cluster(downloaded, settings)
        merged = long_step(on_cluster(small(steps.merge_shards(shards=shards,
                                                                parts=dsl.Collected(downloaded.output))), settings))
        merged.set_caching_options(False)  # rebuilt from what the folder holds now
        train_and_promote(params, merged.outputs["Output"])

    config = run_config(settings)

    if settings.data == "import":
        @dsl.pipeline(name="cloob-pretrain-evaluate-imported", pipeline_config=config,
                      description="CLOOB pretraining and evaluation on shards already on S3 (imported).")
        def pretrain_imported(shards_uri: str, params: str = DEFAULT_PARAMS):
            with ended_by(settings):
                train_and_promote(params, shards_uri)

        return pretrain_imported

    @dsl.pipeline(name="cloob-pretrain-evaluate", pipeline_config=config,
                  description="CLOOB pretraining and evaluation: data gate, sharded download, training, report.")
    def pretrain_evaluate(params: str = DEFAULT_PARAMS):
        with ended_by(settings):
            acquire_train_and_promote(params)

    return pretrain_evaluate


def run_config(settings: ClusterSettings) -> dsl.PipelineConfig | None:
    """The run's own deadline (``run_timeout_s``, its Workflow's activeDeadlineSeconds): what ends a step whose
    pod is never scheduled, whose own deadline counts from its start."""
    if not settings.run_timeout_s:
        return None
    return dsl.PipelineConfig(active_deadline_seconds=math.ceil(settings.run_timeout_s))


def curated(params: str, shards: Any, settings: ClusterSettings) -> Any:
    """The pool scored (a fan-out over ranges of its shards, one GPU pod each where training has GPUs, as the
    evaluation's features step), then curated beside it: the curated shards' location."""
    planned = on_cluster(small(steps.plan_scoring(params=params, shards=shards,
                                                  most=min(settings.partitions, MAX_DOWNLOAD_GROUPS))), settings)
    planned.set_caching_options(False)  # the pool grows under the same name
    with dsl.ParallelFor(items=planned.outputs["Output"], parallelism=settings.scoring_parallelism) as part:
        scored = steps.score_partition(params=params, pool=planned.outputs["pool"], partition=part)
        scored.set_display_name("score")
        scored.set_retry(num_retries=2, backoff_duration="60s")  # it resumes: scored shards keep their parts
        scored.set_caching_options(False)
        with_shared_memory(sized(scored, settings.features_cpus(), settings.eval_memory), settings)
        if settings.features_gpus() > 0:  # else a CPU pod, off the GPU nodes
            on_training_nodes(scored, settings, settings.features_gpus(), settings.eval_node_selector)
        on_cluster(scored, settings, cpu=settings.features_gpus() == 0)
    curation = spilling(long_step(data_step(steps.curate(params=params, shards=shards,
                                                         parts=dsl.Collected(scored.output)), settings)), settings)
    curation.set_caching_options(False)  # the filters are run parameters; the scores grow with the pool
    return curation.outputs["Output"]


def train_task(params: str, shards: Any, settings: ClusterSettings) -> dsl.PipelineTask:
    """One GPU pod (torchrun over its GPUs), or, for several nodes, a small pod that runs the multi-node job and
    waits for it (its service account needs the RBAC in infra/k8s/base/rbac.yaml)."""
    if settings.nodes > 1:
        watcher = steps.train_multinode(params=params, shards=shards, job=settings.to_json(),
                                        run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        # the run's Argo Workflow (ops/trainjob.py): the job's owner, and what tells a stopped run from a drain
        kubernetes.use_field_path_as_env(watcher, env_name=WORKFLOW_ENV,
                                         field_path=f"metadata.labels['{WORKFLOW_LABEL}']")
        with_job_account(watcher, settings)
        not_disrupted(watcher)  # not moved by a consolidation while it watches GPUs
        watcher.set_retry(num_retries=settings.train_retries, backoff_duration=f"{settings.train_retry_backoff_s}s")
        return watcher.set_cpu_request("500m").set_memory_request("1Gi")
    trained = steps.train(params=params, shards=shards, gpus=settings.gpus, workdir=settings.job_workdir,
                          run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, keep_checkpoints=settings.keep_checkpoints)
    for key, value in sorted(settings.nccl_env.items()):  # NCCL joins the GPUs of one node too
        trained.set_env_variable(key, value)
    # an evicted or failed pod is retried, and the retry resumes from the checkpoints mirrored to workdir
    trained.set_retry(num_retries=settings.train_retries, backoff_duration=f"{settings.train_retry_backoff_s}s")
    # bounded as a multi-node job is (its activeDeadlineSeconds): a hung step does not hold a GPU node for ever
    kubernetes.set_timeout(trained, math.ceil(settings.job_timeout_s))
    with_shared_memory(on_training_nodes(sized(trained, settings.training_cpus(), settings.memory), settings,
                                         settings.gpus), settings)
    for key, value in PART_OF.items():  # the PodMonitor in infra/k8s selects training pods by these labels
        kubernetes.add_pod_label(trained, label_key=key, label_value=value)
    not_disrupted(trained)
    if settings.kueue_queue:  # admitted by Kueue's pod integration
        kubernetes.add_pod_label(trained, label_key=KUEUE_QUEUE_LABEL, label_value=settings.kueue_queue)
    return trained


def with_job_account(task: dsl.PipelineTask, settings: ClusterSettings) -> dsl.PipelineTask:
    """The training account (``job_account``) the step talks to the API as, with short-lived tokens it requests
    bound to its own pod (ops/trainjob.py: TrainingToken); no other step talks as it."""
    if settings.job_account:
        task.set_env_variable(JOB_ACCOUNT_ENV, settings.job_account)
        kubernetes.use_field_path_as_env(task, env_name=POD_NAME_ENV, field_path="metadata.name")
        kubernetes.use_field_path_as_env(task, env_name=POD_UID_ENV, field_path="metadata.uid")
    return task


def not_disrupted(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """Karpenter's and the cluster autoscaler's consolidation leave the step's node alone while it runs: for the
    training pods and the long steps, whose loss costs hours (a drain still evicts: docs/kubernetes.md)."""
    for key, value in DO_NOT_DISRUPT.items():
        kubernetes.add_pod_annotation(task, annotation_key=key, annotation_value=value)
    return task


LONG_STEP_RETRIES = 2


def long_step(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """A long CPU step (acquire, the gates, merge, curate): not moved by a consolidation, and tried again after a
    failure (an eviction for node pressure, an OOM kill); each resumes or redoes its work from what it wrote.
    Argo does not retry a pod that was deleted (its node ends Error, not Failed; KFP sets no retryPolicy):
    docs/kubernetes.md, "Disruptions"."""
    task.set_retry(num_retries=LONG_STEP_RETRIES, backoff_duration="60s", backoff_factor=2)
    return not_disrupted(task)


@contextlib.contextmanager
def ended_by(settings: ClusterSettings):
    """The pipeline's tasks under an exit handler that deletes the run's multi-node training job, if one is left,
    however the run ends (a watcher deleted by a drain is not retried, and nothing else would end the job before
    its deadline); no handler for one-node training, which is a step of the run."""
    if settings.nodes == 1:
        yield
        return
    ending = steps.end_training_job(job=settings.to_json(), run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
    ending.set_display_name("end training job")
    on_cluster(small(with_job_account(ending, settings)), settings, s3=False)
    with dsl.ExitHandler(ending, name="the run"):
        yield


SPILL_PATH = "/spill"  # the spill disk of a step that spills
SMALL_STEP = ("500m", "1Gi")  # planning, collecting, reporting, promoting: JSON and small files


def small(task: dsl.PipelineTask) -> dsl.PipelineTask:
    """The requests of a step that reads and writes only small files (a namespace's quota may demand requests)."""
    return task.set_cpu_request(SMALL_STEP[0]).set_memory_request(SMALL_STEP[1])


def sized(task: dsl.PipelineTask, cpus: int | str, memory: str) -> dsl.PipelineTask:
    """CPU (a count or a quantity) and memory requests, and the thread budget's cores, rounded up (a request sets
    no quota for it to read)."""
    task.set_cpu_request(str(cpus)).set_memory_request(memory)
    task.set_env_variable("LOKY_MAX_CPU_COUNT", str(cpu_count(str(cpus))))
    return task


def spilling(task: dsl.PipelineTask, settings: ClusterSettings) -> dsl.PipelineTask:
    """A step that spills (acquire's URL dedup, the manifest gate's counts, curation's joins and buckets) on a disk
    of ``spill_disk`` the scheduler accounts for, named to the step in ``SPILL_ENV`` (not TMPDIR: the launcher's own
    shell would then need the volume, which a kfp.local run does not have)."""
    if settings.spill_disk:
        kubernetes.add_ephemeral_volume(task, volume_name="spill", mount_path=SPILL_PATH,
                                        access_modes=["ReadWriteOnce"], size=settings.spill_disk)
        task.set_env_variable(SPILL_ENV, SPILL_PATH)
    return task


def data_step(task: dsl.PipelineTask, settings: ClusterSettings) -> dsl.PipelineTask:
    """acquire and the data gates: the manifest-wide steps (DuckDB, Great Expectations), within the engine's memory
    limit whatever the rows."""
    return on_cluster(sized(task, settings.data_cpu, settings.data_memory), settings)


def on_training_nodes(task: dsl.PipelineTask, settings: ClusterSettings, gpus: int,
                      node_selector: dict[str, str] | None = None) -> dsl.PipelineTask:
    """On the GPU nodes: ``gpus`` of the accelerator (if any), their taints tolerated, the node affinity, and the
    labels of ``node_selector`` (default: the training pods')."""
    if gpus > 0:
        task.set_accelerator_type(settings.accelerator).set_accelerator_limit(gpus)
    if settings.gpu_tolerations():
        kubernetes.add_toleration_json(task, settings.gpu_tolerations())
    if settings.node_affinity:
        kubernetes.add_node_affinity_json(task, dict(settings.node_affinity))
    for key, value in (settings.node_selector if node_selector is None else node_selector).items():
        kubernetes.add_node_selector(task, label_key=key, label_value=value)
    return task


def with_shared_memory(task: dsl.PipelineTask, settings: ClusterSettings) -> dsl.PipelineTask:
    """A memory-backed /dev/shm, through which data-loader workers hand over their batches."""
    kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                               size_limit=settings.shm)
    return task


def evaluate_and_report(params: str, model: Any, settings: ClusterSettings) -> dsl.PipelineTask:
    """The eval suite of ``params`` (a run parameter, so a recurring run can change it without recompiling),
    fanned out: per data set, its image features once (on a GPU where the settings give one), then one task per
    data set x task on them (CPU pods; retried: they only read), the task results collected per data set; then
    the report over all data sets."""
    planned = on_cluster(small(steps.plan_evaluation(params=params)), settings)
    planned.set_caching_options(False)  # it checks that each entry's source is there now; a cache hit would not
    with dsl.ParallelFor(items=planned.output) as dataset:
        features = steps.prepare_features(params=params, dataset=dataset, model=model)
        features.set_display_name("eval features")
        features.set_retry(num_retries=2, backoff_duration="30s")
        with_shared_memory(sized(features, settings.features_cpus(), settings.eval_memory), settings)
        if settings.features_gpus() > 0:  # else a CPU pod, off the GPU nodes
            on_training_nodes(features, settings, settings.features_gpus(), settings.eval_node_selector)
        on_cluster(features, settings, cpu=settings.features_gpus() == 0)
        with dsl.ParallelFor(items=features.outputs["Output"]) as task:
            evaluated = steps.evaluate(params=params, task=task, model=model, features=features.outputs["features"])
            evaluated.set_display_name("eval task")
            evaluated.set_retry(num_retries=2, backoff_duration="30s")
            sized(evaluated, cpu_count(settings.eval_cpu), settings.eval_memory)
            on_cluster(evaluated, settings)
        collected = on_cluster(small(steps.collect_dataset(dataset=dataset,
                                                           parts=dsl.Collected(evaluated.outputs["results"]))),
                               settings, s3=False)
        collected.set_display_name("eval data set")
    reported = steps.report(params=params, model=model, datasets=dsl.Collected(collected.outputs["results"]))
    return on_cluster(small(reported), settings, s3=False)


def build_evaluation(settings: ClusterSettings | None = None):
    """Scheduled re-evaluation of the production model: the same evaluations, and production's stored metrics
    refreshed so the next promotion compares both models on the same sets."""
    settings = settings or ClusterSettings()

    @dsl.pipeline(name="cloob-evaluate-production", pipeline_config=run_config(settings),
                  description="Re-evaluate the production model of promote.store and record its metrics.")
    def evaluate_production(params: str = DEFAULT_PARAMS):
        current = on_cluster(small(steps.production_model(params=params)), settings)
        current.set_caching_options(False)  # the pointer moves
        reported = evaluate_and_report(params, current.outputs["model"], settings)
        recorded = small(steps.record_production_metrics(params=params, report=reported.outputs["folder"]))
        recorded.set_caching_options(False)
        on_cluster(recorded, settings)

    return evaluate_production
